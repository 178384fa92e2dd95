#include "worker/daemon/device_filter.h"

#include <fcntl.h>
#include <linux/bpf.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace trainyard::worker {
namespace {

struct Device {
  uint32_t type = 0;  // BPF_DEVCG_DEV_CHAR or BPF_DEVCG_DEV_BLOCK
  uint32_t major = 0, minor = 0;
};

// "c 195:1 rwm" (the v1 devices-controller rule that main.cc's DeviceRule writes).
absl::Status ParseRule(const std::string& rule, Device* out) {
  const std::vector<std::string> words = absl::StrSplit(rule, ' ', absl::SkipEmpty());
  const std::vector<std::string> numbers =
      words.size() >= 2 ? absl::StrSplit(words[1], ':') : std::vector<std::string>();
  if (words.size() != 3 || (words[0] != "c" && words[0] != "b") || numbers.size() != 2 ||
      !absl::SimpleAtoi(numbers[0], &out->major) || !absl::SimpleAtoi(numbers[1], &out->minor)) {
    return absl::InvalidArgumentError(
        absl::StrCat("device rule '", rule, "': not \"c MAJOR:MINOR rwm\""));
  }
  out->type = words[0] == "c" ? BPF_DEVCG_DEV_CHAR : BPF_DEVCG_DEV_BLOCK;
  return absl::OkStatus();
}

bpf_insn Insn(uint8_t code, uint8_t dst, uint8_t src, int16_t off, int32_t imm) {
  bpf_insn i{};
  i.code = code;
  i.dst_reg = dst & 0xf;
  i.src_reg = src & 0xf;
  i.off = off;
  i.imm = imm;
  return i;
}

// The program: r1 is the bpf_cgroup_dev_ctx {access_type, major, minor}; 0 denies, 1 allows.
std::vector<bpf_insn> Program(const std::vector<Device>& denied) {
  constexpr uint8_t kLoadWord = BPF_LDX | BPF_W | BPF_MEM;
  constexpr uint8_t kAnd32 = BPF_ALU | BPF_AND | BPF_K;
  constexpr uint8_t kJumpIfNot = BPF_JMP | BPF_JNE | BPF_K;
  constexpr uint8_t kMove = BPF_ALU64 | BPF_MOV | BPF_K;
  constexpr uint8_t kExit = BPF_JMP | BPF_EXIT;
  std::vector<bpf_insn> p = {
      Insn(kLoadWord, 2, 1, 0, 0),    // r2 = access_type
      Insn(kAnd32, 2, 0, 0, 0xffff),  // its low half: the device's type
      Insn(kLoadWord, 3, 1, 4, 0),    // r3 = major
      Insn(kLoadWord, 4, 1, 8, 0),    // r4 = minor
  };
  for (const Device& d : denied) {
    // Not this device: on to the next one (past the rest of this one's five instructions).
    p.push_back(Insn(kJumpIfNot, 2, 0, 4, static_cast<int32_t>(d.type)));
    p.push_back(Insn(kJumpIfNot, 3, 0, 3, static_cast<int32_t>(d.major)));
    p.push_back(Insn(kJumpIfNot, 4, 0, 2, static_cast<int32_t>(d.minor)));
    p.push_back(Insn(kMove, 0, 0, 0, 0));
    p.push_back(Insn(kExit, 0, 0, 0, 0));
  }
  p.push_back(Insn(kMove, 0, 0, 0, 1));
  p.push_back(Insn(kExit, 0, 0, 0, 0));
  return p;
}

long Bpf(int command, bpf_attr* attr) { return syscall(__NR_bpf, command, attr, sizeof(*attr)); }

// The loaded program's descriptor, or the kernel's reason. Loaded without the verifier's log
// (which, full, fails a load that passed: ENOSPC), and again with a large one to say why not.
absl::StatusOr<int> Load(const std::vector<Device>& denied) {
  const std::vector<bpf_insn> program = Program(denied);
  static const char kLicense[] = "Apache-2.0";
  auto load = [&program](char* log, uint32_t size) {
    bpf_attr attr{};
    attr.prog_type = BPF_PROG_TYPE_CGROUP_DEVICE;
    attr.insns = reinterpret_cast<uintptr_t>(program.data());
    attr.insn_cnt = static_cast<uint32_t>(program.size());
    attr.license = reinterpret_cast<uintptr_t>(kLicense);
    if (log != nullptr) {
      attr.log_buf = reinterpret_cast<uintptr_t>(log);
      attr.log_size = size;
      attr.log_level = 1;
    }
    return Bpf(BPF_PROG_LOAD, &attr);
  };
  if (const long fd = load(nullptr, 0); fd >= 0) return static_cast<int>(fd);
  const int err = errno;
  std::vector<char> log(1 << 16, '\0');
  if (const long fd = load(log.data(), static_cast<uint32_t>(log.size())); fd >= 0) {
    return static_cast<int>(fd);  // (passed this time)
  }
  log.back() = '\0';
  std::string why(log.data());
  if (why.size() > 512) why = "..." + why.substr(why.size() - 512);  // (its verdict is last)
  return absl::FailedPreconditionError(absl::StrCat(
      "cannot load a cgroup device program: ", strerror(err), why.empty() ? "" : ": ", why));
}

}  // namespace

absl::Status SetDeviceFilter(const std::string& dir, const std::vector<std::string>& denied) {
  std::vector<Device> devices(denied.size());
  for (size_t i = 0; i < denied.size(); ++i) {
    if (absl::Status s = ParseRule(denied[i], &devices[i]); !s.ok()) return s;
  }
  const int cgroup = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (cgroup < 0) {
    return absl::FailedPreconditionError(absl::StrCat("cgroup ", dir, ": ", strerror(errno)));
  }
  // The programs attached to this folder itself (not its parents'): an earlier rank's.
  uint32_t ids[64] = {0};
  bpf_attr query{};
  query.query.target_fd = static_cast<uint32_t>(cgroup);
  query.query.attach_type = BPF_CGROUP_DEVICE;
  query.query.prog_ids = reinterpret_cast<uintptr_t>(ids);
  query.query.prog_cnt = 64;
  absl::Status status;
  if (Bpf(BPF_PROG_QUERY, &query) != 0) {
    const int err = errno;
    close(cgroup);
    // (Nothing to deny, and no program could be listed: none of ours can be there either.)
    if (devices.empty()) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("cannot list the device programs of cgroup ", dir, ": ", strerror(err)));
  }
  for (uint32_t i = 0; status.ok() && i < std::min<uint32_t>(query.query.prog_cnt, 64); ++i) {
    bpf_attr get{};
    get.prog_id = ids[i];
    const long prog = Bpf(BPF_PROG_GET_FD_BY_ID, &get);
    if (prog < 0) continue;  // (detached meanwhile)
    bpf_attr detach{};
    detach.target_fd = static_cast<uint32_t>(cgroup);
    detach.attach_bpf_fd = static_cast<uint32_t>(prog);
    detach.attach_type = BPF_CGROUP_DEVICE;
    if (Bpf(BPF_PROG_DETACH, &detach) != 0 && errno != ENOENT) {
      status = absl::FailedPreconditionError(absl::StrCat(
          "cannot detach an earlier device program from cgroup ", dir, ": ", strerror(errno)));
    }
    close(static_cast<int>(prog));
  }
  if (status.ok() && !devices.empty()) {
    absl::StatusOr<int> prog = Load(devices);
    if (!prog.ok()) {
      status = prog.status();
    } else {
      bpf_attr attach{};
      attach.target_fd = static_cast<uint32_t>(cgroup);
      attach.attach_bpf_fd = static_cast<uint32_t>(*prog);
      attach.attach_type = BPF_CGROUP_DEVICE;
      attach.attach_flags = BPF_F_ALLOW_MULTI;
      if (Bpf(BPF_PROG_ATTACH, &attach) != 0) {
        status = absl::FailedPreconditionError(absl::StrCat(
            "cannot attach the device program to cgroup ", dir, ": ", strerror(errno)));
      }
      close(*prog);  // (the attachment holds it)
    }
  }
  close(cgroup);
  return status;
}

absl::Status CheckDeviceFilters() {
  absl::StatusOr<int> prog = Load({});
  if (!prog.ok()) return prog.status();
  close(*prog);
  return absl::OkStatus();
}

}  // namespace trainyard::worker
