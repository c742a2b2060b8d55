@0xb0c3f6b1ad0f7396;
# Duet's client protocol over Cap'n Proto RPC.
#
# Versioning: `protocolVersion` grows when a change is not backward
# compatible; fields are only ever added (new ordinals), never renumbered or
# retyped, so an older client keeps working against a newer server. A client
# checks `Gateway.version` before it relies on a newer field.
#
# The bootstrap capability is a `Gateway`. Nothing else is reachable without
# `login`: when the server runs with an API key, `login` must be given it;
# without one, any key (the empty one included) is accepted.

$import "/capnp/c++.capnp".namespace("duet::rpc");

const protocolVersion :UInt32 = 1;

# ---------------------------------------------------------------- errors

enum ErrorKind {
  invalidArgument @0;  # malformed or impossible request
  tooLong @1;          # prompt, or prompt + maxTokens, over a limit
  overloaded @2;       # queue full: retry later
  unavailable @3;      # the server is shutting down
  internal @4;         # a bug of ours
  unauthenticated @5;  # wrong API key
  notFound @6;         # unknown model
}

struct Error {
  kind @0 :ErrorKind;
  message @1 :Text;  # for humans
}

# ---------------------------------------------------------------- requests

struct ChatMessage {
  role @0 :Text;     # "system", "user" or "assistant"
  content @1 :Text;
}

struct Sampling {
  temperature @0 :Float32 = 0;  # 0: greedy
  topK @1 :Int32 = 0;           # 0: off
  topP @2 :Float32 = 1;         # 1: off
  minP @3 :Float32 = 0;         # 0: off
  seed @4 :UInt64 = 0;          # draws are keyed by (seed, position): same seed, same text
  repetitionPenalty @5 :Float32 = 1;
  frequencyPenalty @6 :Float32 = 0;
  presencePenalty @7 :Float32 = 0;
}

struct GenerateRequest {
  prompt :union {
    text @0 :Text;                # tokenized as is (special tokens parsed)
    tokens @1 :List(Int32);       # token ids
    chat @2 :List(ChatMessage);   # the model's chat template is applied
  }
  maxTokens @3 :UInt32 = 0;       # 0: the server's default
  sampling @4 :Sampling;
  stop @5 :List(Text);            # stop strings; the text ends before the first match
  ignoreEos @6 :Bool = false;     # generate exactly maxTokens tokens
  includeTokenIds @7 :Bool = false;  # chunks carry token ids too
  model @8 :Text;                 # empty: the served model
}

# ---------------------------------------------------------------- streaming

struct TokenChunk {
  text @0 :Text;              # new text: valid UTF-8, stop strings held back
  tokenIds @1 :List(Int32);   # the new tokens, when includeTokenIds
}

enum FinishReason {
  stop @0;       # end-of-generation token or stop string
  length @1;     # maxTokens reached
  cancelled @2;  # cancel() or the handle was dropped
  error @3;      # failed after it started; see Finish.error
}

struct Timings {
  queueMs @0 :Float64;   # arrival to first compute
  ttftMs @1 :Float64;    # arrival to first token
  tpotMs @2 :Float64;    # mean gap between later tokens
  e2eMs @3 :Float64;     # arrival to finish
  promptTokens @4 :UInt32;
  completionTokens @5 :UInt32;
  cachedTokens @6 :UInt32;  # prompt tokens served from the prefix cache
  retries @7 :UInt32;       # re-runs after an instance it was on was lost
}

struct Finish {
  reason @0 :FinishReason;
  timings @1 :Timings;
  error @2 :Error;  # set when reason is error
}

interface TokenSink {
  # Implemented by the client. The server calls write() as tokens are made
  # (several tokens per chunk when the client is slower than the model) and
  # done() exactly once at the end.
  write @0 (chunk :TokenChunk) -> stream;
  done @1 (finish :Finish);
}

interface RequestHandle {
  # Dropping the handle cancels the request too.
  cancel @0 ();
}

# ---------------------------------------------------------------- service

struct ModelInfo {
  name @0 :Text;
  contextLength @1 :UInt32;
  vocabSize @2 :UInt32;
  kvCapacityTokens @3 :UInt32;
  maxPromptTokens @4 :UInt32;
  maxTokens @5 :UInt32;
}

struct Stats {
  runningSequences @0 :UInt32;
  waitingSequences @1 :UInt32;
  activeRequests @2 :UInt32;
  finishedRequests @3 :UInt64;
  refusedRequests @4 :UInt64;
  kvBlocksTotal @5 :UInt32;
  kvBlocksFree @6 :UInt32;
  kvBlockTokens @7 :UInt32;
  promptTokens @8 :UInt64;
  prefixHitTokens @9 :UInt64;
  generatedTokens @10 :UInt64;
  steps @11 :UInt64;
  preemptions @12 :UInt64;
  instances @13 :List(InstanceState);  # each instance behind the coordinator
  kvBlocksQuarantined @14 :UInt32;
  draining @15 :Bool;  # stopping: new requests are refused, running ones finish
}

# One instance as the coordinator sees it.
struct InstanceState {
  role @0 :Text;        # "prefill", "decode" or "both"
  leaderRank @1 :Int32;  # -1: in the coordinator's process
  lost @2 :Bool;
  epoch @3 :UInt64;     # the cluster epoch its loss made; 0 while alive
  reason @4 :Text;      # why it was lost, or why it left
  joined @5 :Bool;      # joined the cluster while it served
  draining @6 :Bool;    # leaving: no new work, finishing what it runs
  left @7 :Bool;        # gone after draining (not a loss)
  host @8 :Text;        # a joined instance's host
  switchingTo @9 :Text; # changing role: the one it takes once its work is done ("" if not)
}

enum HealthStatus {
  serving @0;
  shuttingDown @1;  # or no instance left that takes requests
  degraded @2;      # serving, with some instances lost
  draining @3;      # stopping: new requests are refused, running ones finish
}

interface Inference {
  generate @0 (request :GenerateRequest, sink :TokenSink) -> (result :GenerateResult);
  tokenize @1 (text :Text, addSpecial :Bool) -> (result :TokenizeResult);
  detokenize @2 (tokens :List(Int32)) -> (result :DetokenizeResult);
  modelInfo @3 () -> (info :ModelInfo);
  stats @4 () -> (stats :Stats);
  health @5 () -> (status :HealthStatus);
}

struct GenerateResult {
  union {
    started :group {
      handle @0 :RequestHandle;
      promptTokens @1 :UInt32;
    }
    error @2 :Error;  # refused; the sink is never called
  }
}

struct TokenizeResult {
  union {
    tokens @0 :List(Int32);
    error @1 :Error;
  }
}

struct DetokenizeResult {
  union {
    text @0 :Text;
    error @1 :Error;
  }
}

interface Gateway {
  version @0 () -> (protocolVersion :UInt32, server :Text);
  login @1 (apiKey :Text) -> (result :LoginResult);
  # Admin calls prove the cluster key (the server's --cluster-key file)
  # without sending it: adminChallenge gives a fresh nonce, good for one
  # answer on this connection, and admin takes HMAC-SHA256(key, "duet admin"
  # || nonce) (common/net/admin_proof.h).
  adminChallenge @2 () -> (nonce :Data);
  admin @3 (proof :Data) -> (result :AdminResult);
}

struct AdminResult {
  union {
    admin @0 :Admin;
    error @1 :Error;  # unauthenticated (wrong key, or no challenge first), or no admin here
  }
}

# What an administrator may change in a running cluster.
interface Admin {
  # Instance `instance` (its index in Stats.instances) takes `role`
  # ("prefill", "decode" or "both"): no new work of its old role, what it
  # runs finishes, then work of the new one.
  setRole @0 (instance :Int32, role :Text) -> (result :AdminReply);
}

struct AdminReply {
  union {
    done @0 :Text;    # what happens, in one line
    error @1 :Error;  # refused, with the reason
  }
}

struct LoginResult {
  union {
    inference @0 :Inference;
    error @1 :Error;  # unauthenticated
  }
}
