// Token ids of pieces written readably, for the tokenizer tests' expectations.
#pragma once

#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/text/tokenizer.h"

namespace duet::testing {

// `spell` turns a readable piece into the vocabulary's spelling of it (the
// byte-level alphabet, or U+2581 for the space); a piece with no token fails
// the test and reads as -1.
inline std::vector<TokenId> token_ids(const Tokenizer& tokenizer,
                                      const std::vector<std::string>& pieces,
                                      std::string (*spell)(std::string_view)) {
  std::vector<TokenId> ids;
  for (const std::string& piece : pieces) {
    const std::optional<TokenId> id = tokenizer.find_token(spell(piece));
    EXPECT_TRUE(id.has_value()) << "no token for '" << piece << "'";
    ids.push_back(id.value_or(-1));
  }
  return ids;
}

}  // namespace duet::testing
