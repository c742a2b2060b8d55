// What a joining instance and the coordinator compare to know they serve the
// same model file (coordinator/cluster/join_listener.h): a SHA-256 over the
// file's size, its whole header (metadata, tokenizer and tensor table, so every
// shape and weight type) and 64 samples of 4 KiB spread evenly over the
// weights. Reading a few hundred KiB of a 4.5 GB file takes milliseconds and
// still tells apart two quantizations, two vocabularies, or two fine-tunes of
// one shape (their weights differ in every sample). It is not a defence
// against a forged file: the cluster key decides who may join.
//
// Any thread.
#pragma once

#include <string>

namespace duet {

// "sha256:" and 64 hex digits. Throws duet::Error (kNotFound) when the file
// cannot be read, kCorruptFile when it is not a GGUF file.
std::string model_fingerprint(const std::string& path);

}  // namespace duet
