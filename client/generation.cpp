#include "client/generation.h"

#include <type_traits>
#include <utility>

namespace duet::client {
namespace {

std::string to_string(capnp::Text::Reader text) { return std::string(text.cStr(), text.size()); }

Finish read_finish(rpc::Finish::Reader finish) {
  Finish out;
  out.reason = finish.getReason();
  const auto t = finish.getTimings();
  out.timings = {t.getQueueMs(),      t.getTtftMs(),           t.getTpotMs(),      t.getE2eMs(),
                 t.getPromptTokens(), t.getCompletionTokens(), t.getCachedTokens()};
  if (out.reason == rpc::FinishReason::ERROR) {
    out.error_kind = std::string(error_kind_name(finish.getError().getKind()));
    out.error_message = to_string(finish.getError().getMessage());
  }
  return out;
}

void fill_prompt(rpc::GenerateRequest::Builder request, const Prompt& prompt) {
  std::visit(
      [&](const auto& value) {
        using T = std::decay_t<decltype(value)>;
        if constexpr (std::is_same_v<T, std::string>) {
          request.initPrompt().setText(value);
        } else if constexpr (std::is_same_v<T, std::vector<int32_t>>) {
          auto tokens = request.initPrompt().initTokens(static_cast<unsigned>(value.size()));
          for (size_t i = 0; i < value.size(); ++i) tokens.set(static_cast<unsigned>(i), value[i]);
        } else {
          auto messages = request.initPrompt().initChat(static_cast<unsigned>(value.size()));
          for (size_t i = 0; i < value.size(); ++i) {
            messages[static_cast<unsigned>(i)].setRole(value[i].role);
            messages[static_cast<unsigned>(i)].setContent(value[i].content);
          }
        }
      },
      prompt);
}

void fill_options(rpc::GenerateRequest::Builder request, const GenerateOptions& options) {
  request.setMaxTokens(options.max_tokens);
  auto sampling = request.initSampling();
  sampling.setTemperature(options.temperature);
  sampling.setSeed(options.seed);
  sampling.setTopP(options.top_p);
  sampling.setTopK(options.top_k);
  sampling.setMinP(options.min_p);
  auto stop = request.initStop(static_cast<unsigned>(options.stop.size()));
  for (size_t i = 0; i < options.stop.size(); ++i) {
    stop.set(static_cast<unsigned>(i), options.stop[i]);
  }
  request.setIgnoreEos(options.ignore_eos);
}

// The client's side of a request's TokenSink: hands the stream to the
// receiver. Owned by the RPC system (the server holds it); dropped without
// done(), it tells the receiver so, so that a broken connection cannot leave
// anyone waiting.
class ReceiverSink final : public rpc::TokenSink::Server {
 public:
  explicit ReceiverSink(std::unique_ptr<StreamReceiver> receiver)
      : receiver_(std::move(receiver)) {}
  ~ReceiverSink() noexcept(false) {
    if (!finished_) receiver_->on_dropped();
  }

 protected:
  kj::Promise<void> write(WriteContext context) override {
    const auto text = context.getParams().getChunk().getText();
    if (!finished_) receiver_->on_text(std::string_view(text.cStr(), text.size()));
    return kj::READY_NOW;
  }

  kj::Promise<void> done(DoneContext context) override {
    if (!finished_) {
      finished_ = true;
      receiver_->on_finish(read_finish(context.getParams().getFinish()));
    }
    return kj::READY_NOW;
  }

 private:
  std::unique_ptr<StreamReceiver> receiver_;
  bool finished_ = false;
};

}  // namespace

GenerateCall::GenerateCall(rpc::Inference::Client& inference, const Prompt& prompt,
                           const GenerateOptions& options, std::unique_ptr<StreamReceiver> receiver)
    : request_(inference.generateRequest()) {
  auto body = request_.initRequest();
  fill_prompt(body, prompt);
  fill_options(body, options);
  request_.setSink(kj::heap<ReceiverSink>(std::move(receiver)));
}

kj::Promise<GenerateStart> GenerateCall::send() {
  return request_.send().then([](capnp::Response<rpc::Inference::GenerateResults> response) {
    GenerateStart start;
    const auto result = response.getResult();
    if (result.isError()) {
      start.refused = Refusal{std::string(error_kind_name(result.getError().getKind())),
                              to_string(result.getError().getMessage())};
    } else {
      start.handle = result.getStarted().getHandle();
    }
    return start;
  });
}

}  // namespace duet::client
