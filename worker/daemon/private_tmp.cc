#include "worker/daemon/private_tmp.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/msg.h>
#include <sys/sem.h>
#include <sys/shm.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace trainyard::worker {
namespace {

// Whether `path` is the root of a mount (a folder bound on itself, a namespace's file).
bool MountedAt(const std::string& path) {
  struct statx stx {};
  if (statx(AT_FDCWD, path.c_str(), AT_SYMLINK_NOFOLLOW, STATX_BASIC_STATS, &stx) != 0) {
    return false;
  }
  if ((stx.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT) != 0) {
    return (stx.stx_attributes & STATX_ATTR_MOUNT_ROOT) != 0;
  }
  // A kernel before 5.8: a mount point in /proc/self/mountinfo (its fifth field, with space,
  // tab, newline and backslash written in octal).
  std::string escaped;
  for (char c : path) {
    if (c == ' ' || c == '\t' || c == '\n' || c == '\\') {
      absl::StrAppend(&escaped, "\\", absl::Dec(c >> 6), absl::Dec((c >> 3) & 7), absl::Dec(c & 7));
    } else {
      escaped.push_back(c);
    }
  }
  std::ifstream mountinfo("/proc/self/mountinfo");
  for (std::string line; std::getline(mountinfo, line);) {
    const std::vector<absl::string_view> fields = absl::StrSplit(line, ' ');
    if (fields.size() > 4 && fields[4] == escaped) return true;
  }
  return false;
}

// Unmounts what is mounted at `path` (stacked mounts one at a time) and removes the file.
bool UnmountFile(const std::string& path) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) return errno == ENOENT;
  for (int i = 0; i < 16 && MountedAt(path); ++i) {
    if (umount2(path.c_str(), MNT_DETACH | UMOUNT_NOFOLLOW) != 0) return false;
  }
  return !MountedAt(path) && (unlink(path.c_str()) == 0 || errno == ENOENT);
}

// The per-mount flags of the mount holding `path`, as mount(2) takes them, with nosuid and nodev.
unsigned long BindFlags(const std::string& path) {
  unsigned long flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV;
  struct statvfs vfs {};
  if (statvfs(path.c_str(), &vfs) != 0) return flags;
  for (const auto& [st, ms] : {std::pair<unsigned long, unsigned long>{ST_RDONLY, MS_RDONLY},
                               {ST_NOEXEC, MS_NOEXEC},
                               {ST_NOATIME, MS_NOATIME},
                               {ST_NODIRATIME, MS_NODIRATIME},
                               {ST_RELATIME, MS_RELATIME}}) {
    if ((vfs.f_flag & st) != 0) flags |= ms;
  }
  return flags;
}

}  // namespace

std::string PrivateFolderOver(const std::string& path, bool resolve_links) {
  if (path.empty()) return "";
  std::error_code ec;
  std::string resolved = resolve_links ? std::filesystem::weakly_canonical(path, ec).string() : "";
  if (!resolve_links || ec) resolved = std::filesystem::path(path).lexically_normal().string();
  if (resolved.size() > 1 && resolved.back() == '/') resolved.pop_back();
  for (const char* folder : {"/tmp", "/dev/shm"}) {
    std::string base = resolve_links ? std::filesystem::weakly_canonical(folder, ec).string() : "";
    if (!resolve_links || ec || base.empty()) base = folder;
    if (resolved == base || absl::StartsWith(resolved, base + "/")) return folder;
  }
  return "";
}

absl::Status CheckMountNamespaces() {
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", strerror(errno)));
  if (pid == 0) _exit(unshare(CLONE_NEWNS | CLONE_NEWIPC) == 0 ? 0 : errno);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("cannot give ranks a mount and an IPC namespace of their own: unshare: ",
                   WIFEXITED(status) ? strerror(WEXITSTATUS(status)) : "the child was killed",
                   geteuid() != 0 ? " (it takes a worker running as root)" : ""));
}

std::string NamespaceFolder(const std::string& work_dir) { return work_dir + "/.namespaces"; }

absl::Status PrepareNamespaceFolder(const std::string& folder) {
  if (mkdir(folder.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::FailedPreconditionError(absl::StrCat("mkdir ", folder, ": ", strerror(errno)));
  }
  struct stat st {};
  if (lstat(folder.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid() ||
      chmod(folder.c_str(), 0700) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(folder, " is not a folder of this worker's account"));
  }
  if (!MountedAt(folder) && mount(folder.c_str(), folder.c_str(), nullptr, MS_BIND, nullptr) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot bind ", folder, " on itself: ", strerror(errno)));
  }
  if (mount(nullptr, folder.c_str(), nullptr, MS_PRIVATE, nullptr) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot make ", folder, " a private mount: ", strerror(errno)));
  }
  return absl::OkStatus();
}

AttemptNamespaces NamespacesOf(const std::string& folder, const std::string& job_id, int attempt) {
  const std::string prefix = absl::StrCat(folder, "/", job_id, "@", attempt);
  return AttemptNamespaces{prefix + ".mnt", prefix + ".ipc"};
}

bool ParseNamespaceName(const std::string& name, std::string* job_id, int* attempt) {
  absl::string_view rest = name;
  if (!absl::ConsumeSuffix(&rest, ".mnt") && !absl::ConsumeSuffix(&rest, ".ipc")) return false;
  const size_t at = rest.rfind('@');
  if (at == absl::string_view::npos || at == 0 || !absl::SimpleAtoi(rest.substr(at + 1), attempt) ||
      *attempt <= 0) {
    return false;
  }
  *job_id = std::string(rest.substr(0, at));
  return true;
}

int64_t AttemptShmBytes(int64_t rank_bytes, int ranks, int64_t host_bytes) {
  if (rank_bytes <= 0 || ranks <= 0) return 0;
  const int64_t ranks_bytes = rank_bytes > std::numeric_limits<int64_t>::max() / ranks
                                  ? std::numeric_limits<int64_t>::max()
                                  : rank_bytes * ranks;
  return host_bytes > 0 ? std::min(ranks_bytes, host_bytes / 2) : ranks_bytes;
}

absl::Status MakeAttemptNamespaces(const AttemptNamespaces& ns, const std::string& namespace_folder,
                                   const std::string& tmp, uid_t uid, gid_t gid,
                                   int64_t shm_bytes) {
  if (MountedAt(ns.mnt) && MountedAt(ns.ipc)) return absl::OkStatus();  // (its other ranks)
  RemoveAttemptNamespaces(ns);  // (half made, by a worker that died meanwhile)
  for (const std::string& file : {ns.mnt, ns.ipc}) {
    const int fd = open(file.c_str(), O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot make ", file, ": ", strerror(errno)));
    }
    close(fd);
  }
  // All the child needs, made before it is forked (it may not allocate).
  const std::string shm_options =
      absl::StrCat("mode=0700,uid=", uid, ",gid=", gid,
                   shm_bytes > 0 ? absl::StrCat(",size=", shm_bytes) : std::string());
  const unsigned long tmp_flags = BindFlags(tmp);
  struct stat mqueue {};
  const bool has_mqueue = stat("/dev/mqueue", &mqueue) == 0 && S_ISDIR(mqueue.st_mode);
  // A child makes the namespaces and waits while their files are bound; the mounts keep them.
  int made[2], done[2];
  if (pipe2(made, O_CLOEXEC) != 0) return absl::InternalError(strerror(errno));
  if (pipe2(done, O_CLOEXEC) != 0) {
    close(made[0]);
    close(made[1]);
    return absl::InternalError(strerror(errno));
  }
  const pid_t pid = fork();
  if (pid == 0) {
    close(made[0]);
    close(done[1]);
    int result[2] = {0, 0};  // errno, step
    auto step = [&result](int number, bool ok) {
      if (result[0] == 0 && !ok) result[0] = errno, result[1] = number;
      return result[0] == 0;
    };
    // The folder's copies are dropped here: a copy of another attempt's namespace's file would
    // keep that namespace (its tmpfs) while this one lives.
    step(1, unshare(CLONE_NEWNS | CLONE_NEWIPC) == 0) &&
        step(2, mount("none", "/", nullptr, MS_REC | MS_SLAVE, nullptr) == 0) &&
        step(3, umount2(namespace_folder.c_str(), MNT_DETACH) == 0) &&
        step(4,
             mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, shm_options.c_str()) == 0) &&
        step(5, mount(tmp.c_str(), "/tmp", nullptr, MS_BIND, nullptr) == 0) &&
        step(6, mount(nullptr, "/tmp", nullptr, tmp_flags, nullptr) == 0) &&
        // (POSIX message queues by name: those of the new IPC namespace.)
        step(7, !has_mqueue || mount("mqueue", "/dev/mqueue", "mqueue",
                                     MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) == 0);
    (void)!write(made[1], result, sizeof(result));
    char byte;
    (void)!read(done[0], &byte, 1);  // until the worker closes its end
    _exit(0);
  }
  close(made[1]);
  close(done[0]);
  int result[2] = {pid < 0 ? errno : 0, 0};
  if (pid > 0 && read(made[0], result, sizeof(result)) != sizeof(result)) result[0] = ECHILD;
  static const char* const kSteps[] = {"fork",
                                       "unshare",
                                       "make the mounts the host's slaves",
                                       "leave out the namespace folder",
                                       "mount a tmpfs over /dev/shm",
                                       "bind the attempt's tmp over /tmp",
                                       "make /tmp nosuid and nodev",
                                       "mount the IPC namespace's /dev/mqueue"};
  std::string failed = result[0] != 0 ? kSteps[std::clamp(result[1], 0, 7)] : "";
  for (const auto& [file, kind] : {std::pair{ns.ipc, "ipc"}, std::pair{ns.mnt, "mnt"}}) {
    const std::string source = absl::StrCat("/proc/", pid, "/ns/", kind);
    if (result[0] == 0 && mount(source.c_str(), file.c_str(), nullptr, MS_BIND, nullptr) != 0) {
      result[0] = errno;
      failed = absl::StrCat("bind its ", kind, " namespace at ", file);
    }
  }
  close(made[0]);
  close(done[1]);  // (the child's read ends: written to, a child already gone would SIGPIPE us)
  if (pid > 0) {
    while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
  if (result[0] != 0) {
    RemoveAttemptNamespaces(ns);
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot make the attempt's private /tmp: ", failed, ": ", strerror(result[0])));
  }
  return absl::OkStatus();
}

namespace {

union SemArgument {  // semctl's fourth argument (the caller defines it: semctl(2))
  int value;
  semid_ds* ds;
  unsigned short* array;
  seminfo* info;
};

// In a forked child (nothing allocated): joins the attempt's namespaces and empties them: every
// SysV segment, semaphore set and message queue removed, every POSIX queue unlinked, /dev/shm
// unmounted.
void EmptyFromInside(const char* mnt, const char* ipc) {
  const int ipc_fd = open(ipc, O_RDONLY | O_CLOEXEC);
  const int mnt_fd = open(mnt, O_RDONLY | O_CLOEXEC);
  if (ipc_fd < 0 || mnt_fd < 0 || setns(ipc_fd, CLONE_NEWIPC) != 0 ||
      setns(mnt_fd, CLONE_NEWNS) != 0) {
    _exit(1);
  }
  shm_info shm{};
  const int shm_max = shmctl(0, SHM_INFO, reinterpret_cast<shmid_ds*>(&shm));
  for (int i = 0; i <= shm_max; ++i) {
    shmid_ds ds{};
    if (const int id = shmctl(i, SHM_STAT, &ds); id >= 0) shmctl(id, IPC_RMID, nullptr);
  }
  seminfo sem{};
  SemArgument info{};
  info.info = &sem;
  const int sem_max = semctl(0, 0, SEM_INFO, info);
  for (int i = 0; i <= sem_max; ++i) {
    semid_ds ds{};
    SemArgument stat{};
    stat.ds = &ds;
    if (const int id = semctl(i, 0, SEM_STAT, stat); id >= 0) semctl(id, 0, IPC_RMID);
  }
  msginfo msg{};
  const int msg_max = msgctl(0, MSG_INFO, reinterpret_cast<msqid_ds*>(&msg));
  for (int i = 0; i <= msg_max; ++i) {
    msqid_ds ds{};
    if (const int id = msgctl(i, MSG_STAT, &ds); id >= 0) msgctl(id, IPC_RMID, nullptr);
  }
  // POSIX queues: the names in the namespace's own /dev/mqueue (MakeAttemptNamespaces).
  if (const int queues = open("/dev/mqueue", O_RDONLY | O_DIRECTORY | O_CLOEXEC); queues >= 0) {
    alignas(8) char buf[4096];
    long n;
    while ((n = syscall(SYS_getdents64, queues, buf, sizeof(buf))) > 0) {
      for (long at = 0; at < n;) {
        const auto* entry = reinterpret_cast<const dirent64*>(buf + at);
        if (std::strcmp(entry->d_name, ".") != 0 && std::strcmp(entry->d_name, "..") != 0) {
          unlinkat(queues, entry->d_name, 0);
        }
        at += entry->d_reclen;
      }
    }
    close(queues);
  }
  umount2("/dev/shm", MNT_DETACH);
  _exit(0);
}

// The attempt's namespaces emptied from inside (EmptyFromInside), in a child: what a process
// that still holds them (one that opened a rank's /proc/PID/ns files, a copy in a mount
// namespace made later) keeps is then only its own open files.
void EmptyAttemptNamespaces(const AttemptNamespaces& ns) {
  const pid_t pid = fork();
  if (pid == 0) EmptyFromInside(ns.mnt.c_str(), ns.ipc.c_str());
  if (pid < 0) return;
  while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
  }
}

}  // namespace

bool RemoveAttemptNamespaces(const AttemptNamespaces& ns) {
  if (MountedAt(ns.mnt) && MountedAt(ns.ipc)) EmptyAttemptNamespaces(ns);
  const bool mnt = UnmountFile(ns.mnt);
  return UnmountFile(ns.ipc) && mnt;
}

absl::Status TryAttemptNamespaces(const std::string& work_dir) {
  const std::string folder = NamespaceFolder(work_dir);
  // (Attempt 0, a name no scan takes for an attempt's; what a trial of a killed worker left
  // goes first.)
  const AttemptNamespaces ns = NamespacesOf(folder, "start-check", 0);
  const std::string tmp = work_dir + "/.private-tmp-check";
  RemoveAttemptNamespaces(ns);
  std::error_code ec;
  std::filesystem::remove_all(tmp, ec);
  if (mkdir(tmp.c_str(), 0700) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("mkdir ", tmp, ": ", strerror(errno)));
  }
  struct stat want {};
  if (stat(tmp.c_str(), &want) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("stat ", tmp, ": ", strerror(errno)));
  }
  absl::Status made = MakeAttemptNamespaces(ns, folder, tmp, geteuid(), getegid(), 1 << 20);
  if (made.ok()) {
    const std::string mnt = ns.mnt, ipc = ns.ipc;
    const pid_t pid = fork();
    if (pid == 0) {
      const char* step = "";
      if (EnterAttemptNamespaces(mnt.c_str(), ipc.c_str(), &step) != 0) _exit(1);
      struct stat got {};
      _exit(stat("/tmp", &got) == 0 && got.st_dev == want.st_dev && got.st_ino == want.st_ino ? 0
                                                                                              : 2);
    }
    int status = 0;
    while (pid > 0 && waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (pid < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      made = absl::FailedPreconditionError(
          pid < 0 ? absl::StrCat("fork: ", strerror(errno))
          : WIFEXITED(status) && WEXITSTATUS(status) == 2
              ? "a rank that joined its attempt's namespaces did not see the attempt's /tmp"
              : "a rank could not join its attempt's namespaces (setns)");
    }
  }
  if (!RemoveAttemptNamespaces(ns) && made.ok()) {
    made = absl::FailedPreconditionError(
        absl::StrCat("cannot unmount a trial attempt's namespaces in ", folder));
  }
  std::filesystem::remove_all(tmp, ec);
  return made;
}

int EnterAttemptNamespaces(const char* mnt, const char* ipc, const char** step) {
  // Both opened first: the namespace folder is not in the attempt's mount namespace.
  *step = "open the attempt's namespaces";
  const int ipc_fd = open(ipc, O_RDONLY | O_CLOEXEC);
  const int mnt_fd = open(mnt, O_RDONLY | O_CLOEXEC);
  int err = ipc_fd < 0 || mnt_fd < 0 ? errno : 0;
  if (err == 0) {
    *step = "join the attempt's IPC namespace";
    if (setns(ipc_fd, CLONE_NEWIPC) != 0) err = errno;
  }
  if (err == 0) {
    *step = "join the attempt's mount namespace";
    if (setns(mnt_fd, CLONE_NEWNS) != 0) err = errno;
  }
  if (ipc_fd >= 0) close(ipc_fd);
  if (mnt_fd >= 0) close(mnt_fd);
  return err;
}

}  // namespace trainyard::worker
