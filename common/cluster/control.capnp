@0xf2491b554425a01e;
# Duet's control plane: the messages between the coordinator (rank 0) and the
# instance leaders, carried over MPI (common/mpi/control_channel.h). Separate
# from the client protocol (duet.capnp): this one never leaves the MPI job.
#
# Every MPI message is one `Message`. The plain C++ form of each struct, and
# the conversions, are in common/cluster/control_messages.h; nothing else reads these
# types.
#
# Versioning: `protocolVersion` grows with every change that is not backward
# compatible. Each leader's first message is a `Hello` carrying it; the
# coordinator refuses a cluster in which any rank speaks another version,
# before any other message flows. Fields are only ever added (new ordinals).

$import "/capnp/c++.capnp".namespace("duet::control");

const protocolVersion :UInt32 = 4;  # 2: InstanceReady; 3: disaggregation; 4: TP KV

enum Role {
  prefill @0;
  decode @1;
  both @2;  # colocated
}

# ---------------------------------------------------------------- handshake

# Leader -> coordinator, first message. Echoes what the leader read in the
# cluster spec, so that a rank started with another spec is caught.
struct Hello {
  protocolVersion @0 :UInt32;
  rank @1 :Int32;
  instanceId @2 :Int32;
  role @3 :Role;
}

# Coordinator -> each rank of every instance, once every leader said Hello.
# A refusal is for the whole cluster: every rank stops with `reason`.
struct HelloReply {
  accepted @0 :Bool;
  protocolVersion @1 :UInt32;  # the coordinator's
  reason @2 :Text;             # why not, when refused
}

# ---------------------------------------------------------------- requests

# common/sampling.h SamplingParams, field for field.
struct Sampling {
  temperature @0 :Float32;
  seed @1 :UInt64;
  topK @2 :Int32;
  topP @3 :Float32;
  minP @4 :Float32;
  repetitionPenalty @5 :Float32;
  frequencyPenalty @6 :Float32;
  presencePenalty @7 :Float32;
  penaltyLastN @8 :Int32;
}

# common/serving.h InstanceRequest. Coordinator -> leader.
struct SubmitRequest {
  id @0 :UInt64;
  prompt @1 :List(Int32);  # token ids, chat template applied
  maxTokens @2 :Int64;
  sampling @3 :Sampling;
  ignoreEos @4 :Bool;
  # Disaggregated: the rank of the prefill instance's leader that computes
  # the prompt's KV for this decode instance; -1: the instance computes it.
  prefillRank @5 :Int32 = -1;
}

# Coordinator -> leader: end a request and free its KV.
struct Cancel {
  id @0 :UInt64;
}

# ---------------------------------------------------------------- events

enum Finish {
  endOfGeneration @0;
  length @1;
  cancelled @2;
  failed @3;
}

enum ErrorKind {
  invalidArgument @0;
  tooLong @1;
  notFound @2;
  unauthenticated @3;
  overloaded @4;
  unavailable @5;
  internal @6;
}

struct Error {
  kind @0 :ErrorKind;
  message @1 :Text;
}

# common/serving.h InstanceEvent.
struct Event {
  id @0 :UInt64;
  admitted @1 :Bool;
  cachedTokens @2 :Int64;
  # How long before this message was encoded the admission happened, in ns
  # (-1: not admitted). A duration, not a time: the hosts' clocks differ, so
  # the receiver places the admission at its own receive time minus this.
  admittedAgoNs @3 :Int64;
  token @4 :Int32;  # -1: none
  finished @5 :Bool;
  finish @6 :Finish;
  hasError @7 :Bool;
  error @8 :Error;  # when hasError
}

# Leader -> coordinator: everything one engine step produced, for every
# sequence of the instance (a decode step's tokens travel in one message).
struct StepEvents {
  instanceId @0 :Int32;
  step @1 :Int64;  # the engine's step counter
  events @2 :List(Event);
}

# Leader -> coordinator: common/serving.h InstanceStats.
struct Stats {
  instanceId @0 :Int32;
  running @1 :Int64;
  waiting @2 :Int64;
  kvBlocksTotal @3 :Int64;
  kvBlocksFree @4 :Int64;
  kvBlockTokens @5 :Int64;
  steps @6 :Int64;
  promptTokens @7 :Int64;
  prefixHitTokens @8 :Int64;
  generatedTokens @9 :Int64;
  preemptions @10 :Int64;
}

# Leader -> coordinator, once after the handshake, when the instance has
# loaded its model and can take requests: what the coordinator needs to
# validate requests (common/serving.h InstanceInfo) and the first stats. Or,
# with `error` set, why it could not start (the coordinator then shuts the
# cluster down).
struct InstanceReady {
  instanceId @0 :Int32;
  modelName @1 :Text;
  nCtx @2 :Int64;
  nVocab @3 :Int64;
  kvCapacityTokens @4 :Int64;
  endOfGeneration @5 :List(Int32);
  stats @6 :Stats;
  error @7 :Text;  # empty: ready
}

# Coordinator -> leader: finish up; the channel closes next.
struct Shutdown {
  reason @0 :Text;
}

# ---------------------------------------------------------------- between instances

# Decode leader -> prefill leader, on the KV transfer's communicator, once
# the decode instance has reserved the prompt's blocks: compute the prompt,
# ship the KV rows of positions >= sendFrom (the decode side holds the rest in
# its prefix cache), then a KvHandoff. A `cancel` with the same id withdraws it.
struct PrefillOrder {
  request @0 :SubmitRequest;
  sendFrom @1 :Int64;
  decodeRanks @2 :List(Int32);  # the decode instance's ranks, leader first (its TP size)
}

# Prefill leader -> decode leader, after the last rows of a PrefillOrder
# (messages between two ranks keep their order, so every row is there).
struct KvHandoff {
  id @0 :UInt64;
  firstToken @1 :Int32;    # sampled after the prompt, as one engine would; -1 on error
  cachedTokens @2 :Int64;  # prompt tokens the prefill side's prefix cache held
  prefillNs @3 :Int64;     # from the prefill admission to this handoff
  rowsSent @4 :Int64;      # KV rows (positions x layers) shipped for it
  hasError @5 :Bool;
  error @6 :Error;  # when hasError: the prefill failed or was withdrawn; no rows follow
}

# ---------------------------------------------------------------- envelope

struct Message {
  union {
    hello @0 :Hello;
    helloReply @1 :HelloReply;
    submit @2 :SubmitRequest;
    cancel @3 :Cancel;
    stepEvents @4 :StepEvents;
    stats @5 :Stats;
    shutdown @6 :Shutdown;
    ready @7 :InstanceReady;
    prefillOrder @8 :PrefillOrder;
    kvHandoff @9 :KvHandoff;
  }
}
