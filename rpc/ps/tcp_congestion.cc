#include "rpc/ps/tcp_congestion.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <grpc/support/sync.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/support/channel_arguments.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

// gRPC's socket mutator (src/core/lib/iomgr/socket_mutator.h) is the one way to set options on
// the sockets gRPC opens. Its public headers name the type and the channel argument but leave the
// definition internal, so the layout is declared here as gRPC 1.51 (Debian 12) defines it; it has
// not changed since mutate_fd_2 was added in 1.33. mutate_fd_2 must be set: without it gRPC
// mutates client connections and listeners but skips the connections a server accepts.
typedef enum {
  GRPC_FD_CLIENT_CONNECTION_USAGE,
  GRPC_FD_SERVER_LISTENER_USAGE,
  GRPC_FD_SERVER_CONNECTION_USAGE,
} grpc_fd_usage;

typedef struct {
  int fd;
  grpc_fd_usage usage;
} grpc_mutate_socket_info;

struct grpc_socket_mutator_vtable {
  bool (*mutate_fd)(int fd, grpc_socket_mutator* mutator);
  int (*compare)(grpc_socket_mutator* a, grpc_socket_mutator* b);
  void (*destroy)(grpc_socket_mutator* mutator);
  bool (*mutate_fd_2)(const grpc_mutate_socket_info* info, grpc_socket_mutator* mutator);
};

struct grpc_socket_mutator {
  const grpc_socket_mutator_vtable* vtable;
  gpr_refcount refcount;
};

void grpc_socket_mutator_init(grpc_socket_mutator* mutator,
                              const grpc_socket_mutator_vtable* vtable);

namespace trainyard::ps {
namespace {

constexpr size_t kMaxNameBytes = 16;  // the kernel's TCP_CA_NAME_MAX, with its terminating 0

std::string ReadSysctl(const char* path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return std::string(absl::StripAsciiWhitespace(text.str()));
}

// A mutator that sets one congestion control. Standard layout with the gRPC base first, so the
// pointers gRPC hands back convert to it.
struct CongestionMutator {
  grpc_socket_mutator base;
  char name[kMaxNameBytes];
};

CongestionMutator* Cast(grpc_socket_mutator* m) { return reinterpret_cast<CongestionMutator*>(m); }

bool MutateFd(int fd, grpc_socket_mutator* m) {
  int protocol = 0;
  socklen_t len = sizeof(protocol);
  if (getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &protocol, &len) != 0 || protocol != IPPROTO_TCP) {
    return true;  // a Unix socket, say: nothing to set
  }
  if (absl::Status s = SetSocketTcpCongestion(fd, Cast(m)->name); !s.ok()) {
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      spdlog::warn("{}: cannot set it on a socket; it keeps the host's", std::string(s.message()));
    }
  }
  return true;  // false would make gRPC drop the connection
}

bool MutateFd2(const grpc_mutate_socket_info* info, grpc_socket_mutator* m) {
  return MutateFd(info->fd, m);
}

int Compare(grpc_socket_mutator* a, grpc_socket_mutator* b) {
  return std::strcmp(Cast(a)->name, Cast(b)->name);
}

void Destroy(grpc_socket_mutator* m) { delete Cast(m); }

constexpr grpc_socket_mutator_vtable kVtable = {MutateFd, Compare, Destroy, MutateFd2};

// A new mutator holding one reference, which the channel arguments take over.
grpc_socket_mutator* NewMutator(const std::string& name) {
  auto* m = new CongestionMutator{};
  std::strncpy(m->name, name.c_str(), kMaxNameBytes - 1);
  grpc_socket_mutator_init(&m->base, &kVtable);
  return &m->base;
}

class CongestionOption : public grpc::ServerBuilderOption {
 public:
  explicit CongestionOption(std::string name) : name_(std::move(name)) {}
  void UpdateArguments(grpc::ChannelArguments* args) override { SetTcpCongestion(args, name_); }
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>*) override {}

 private:
  const std::string name_;
};

}  // namespace

absl::StatusOr<std::string> HostTcpCongestion() {
  const std::string name = ReadSysctl("/proc/sys/net/ipv4/tcp_congestion_control");
  if (name.empty()) {
    return absl::UnavailableError("cannot read /proc/sys/net/ipv4/tcp_congestion_control");
  }
  return name;
}

absl::Status CheckTcpCongestion(const std::string& name, const std::string& flag) {
  if (name.empty()) return absl::OkStatus();
  if (name.size() >= kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", name, "\" is longer than a congestion control name can be"));
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  const absl::Status set = SetSocketTcpCongestion(fd, name);
  close(fd);
  if (set.ok()) return absl::OkStatus();
  if (set.code() == absl::StatusCode::kPermissionDenied) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", name, "\" is not allowed for this process (allowed: ",
                     ReadSysctl("/proc/sys/net/ipv4/tcp_allowed_congestion_control"),
                     "); run as root or add it to net.ipv4.tcp_allowed_congestion_control"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      flag, ": \"", name, "\" is not a congestion control this kernel has (", set.message(),
      "; available: ", ReadSysctl("/proc/sys/net/ipv4/tcp_available_congestion_control"), ")"));
}

std::string TcpCongestionInUse(const std::string& name) {
  if (!name.empty()) return name;
  return HostTcpCongestion().value_or("unknown") + " (the host's)";
}

absl::Status SetSocketTcpCongestion(int fd, const std::string& name) {
  if (name.empty() || setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name.data(), name.size()) == 0) {
    return absl::OkStatus();
  }
  const int error = errno;
  const std::string message = absl::StrCat("TCP_CONGESTION ", name, ": ", std::strerror(error));
  return error == EPERM ? absl::PermissionDeniedError(message)
                        : absl::InvalidArgumentError(message);
}

absl::StatusOr<std::string> SocketTcpCongestion(int fd) {
  char name[kMaxNameBytes] = {};
  socklen_t len = sizeof(name);
  if (getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &len) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("fd ", fd, ": no TCP congestion control: ", std::strerror(errno)));
  }
  return std::string(name, strnlen(name, len));
}

void SetTcpCongestion(grpc::ChannelArguments* args, const std::string& name) {
  if (name.empty()) return;
  args->SetSocketMutator(NewMutator(name));
}

std::unique_ptr<grpc::ServerBuilderOption> TcpCongestionOption(const std::string& name) {
  return std::make_unique<CongestionOption>(name);
}

}  // namespace trainyard::ps
