// Frames over one connected, non-blocking stream socket per peer rank (made
// by connect_tcp_peers, common/net/tcp_connect.h): the control channel's link
// between hosts (common/control_plane/control_channel.h). No MPI.
//
// A frame is an 8-byte header, the body's length and a tag (each a uint32,
// little-endian), then the body. Frames to one peer leave in the order they
// were queued; frames from one peer come out of pump() in the order they
// were sent, whole.
//
// A peer's connection ends on EOF, a reset, a broken pipe, or a frame longer
// than max_frame_bytes (bytes that are not this link's): its socket is
// closed, what was queued for it is dropped, and pump() reports it once,
// after the frames that had arrived whole before it ended. Nothing ever blocks
// but wait(). Not thread-safe: one thread owns the link (the control channel's
// communication thread).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace duet {

class TcpFrameLink final {
 public:
  static constexpr size_t kHeaderBytes = 8;
  static constexpr size_t kDefaultMaxFrameBytes = size_t{1} << 30;

  struct Frame {
    int peer = 0;
    uint32_t tag = 0;
    std::vector<std::byte> body;
  };
  struct Ended {
    int peer = 0;
    std::string why;  // "closed the connection", "Connection reset by peer"
  };

  // `sockets`: a connected socket to every peer, by rank, owned from now on.
  explicit TcpFrameLink(std::map<int, int> sockets, size_t max_frame_bytes = kDefaultMaxFrameBytes);
  ~TcpFrameLink();  // closes every socket still open
  TcpFrameLink(const TcpFrameLink&) = delete;
  TcpFrameLink& operator=(const TcpFrameLink&) = delete;

  // Adds `peer` (never seen before) with its connected socket, owned from
  // now on: a member that joined at runtime.
  void add(int peer, int socket);

  // Whether `peer`'s connection is open (neither ended nor dropped).
  bool connected(int peer) const;
  // Queues one frame for `peer`; false (nothing queued) once its connection
  // has ended or was dropped. Writes nothing yet: pump() does.
  bool queue(int peer, uint32_t tag, std::span<const std::byte> body);
  // Whether queued bytes wait to be written to a connected peer.
  bool writing() const;

  // Writes what the sockets take now and reads what has arrived: appends the
  // frames now whole to `frames` (in order per peer) and the connections
  // that ended to `ended`. True when any byte moved or a connection ended.
  bool pump(std::vector<Frame>& frames, std::vector<Ended>& ended);

  // Returns when a socket has bytes (or an EOF, an error) to read, a queued
  // write can move, `wake_fd` (-1: none) is readable, or after `timeout`
  // (nullopt: no limit). Reads nothing.
  void wait(int wake_fd, std::optional<std::chrono::microseconds> timeout) const;

  // Ends `peer`'s connection on purpose (a rank given up): what the socket
  // takes at once still leaves, then it is closed; that is not reported. No
  // effect once ended.
  void drop(int peer);

 private:
  struct Peer {
    int fd = -1;
    std::vector<std::byte> out;  // frames queued, out[out_sent..] not yet written
    size_t out_sent = 0;
    std::vector<std::byte> in;  // in[0..in_used) read, not yet a whole frame
    size_t in_used = 0;

    void close_socket();  // closes fd (-1 after) and forgets both buffers
  };
  // False when the connection ended (reported in `ended`).
  bool write_some(int peer, Peer& p, std::vector<Ended>& ended, bool& moved);
  bool read_some(int peer, Peer& p, std::vector<Frame>& frames, std::vector<Ended>& ended,
                 bool& moved);
  void end(int peer, Peer& p, std::string why, std::vector<Ended>& ended);

  const size_t max_frame_bytes_;
  std::map<int, Peer> peers_;  // every peer ever connected; fd -1 once ended
};

}  // namespace duet
