#include "worker/daemon/private_tmp.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace trainyard::worker {
namespace {

// Whether `path` is a mount point: a folder, or a file (a namespace's), on another device than
// its parent's.
bool MountedAt(const std::string& path) {
  struct stat st {};
  struct stat parent {};
  return stat(path.c_str(), &st) == 0 &&
         stat(std::filesystem::path(path).parent_path().c_str(), &parent) == 0 &&
         st.st_dev != parent.st_dev;
}

}  // namespace

std::string PrivateFolderOver(const std::string& path) {
  if (path.empty()) return "";
  std::error_code ec;
  std::string resolved = std::filesystem::weakly_canonical(path, ec).string();
  if (ec) resolved = std::filesystem::path(path).lexically_normal().string();
  for (const char* folder : {"/tmp", "/dev/shm"}) {
    std::string base = std::filesystem::weakly_canonical(folder, ec).string();
    if (ec || base.empty()) base = folder;
    if (resolved == base || absl::StartsWith(resolved, base + "/")) return folder;
  }
  return "";
}

absl::Status CheckMountNamespaces() {
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", strerror(errno)));
  if (pid == 0) _exit(unshare(CLONE_NEWNS) == 0 ? 0 : errno);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("cannot give a rank a mount namespace of its own: unshare: ",
                   WIFEXITED(status) ? strerror(WEXITSTATUS(status)) : "the child was killed",
                   geteuid() != 0 ? " (it takes a worker running as root)" : ""));
}

absl::Status MountAttemptShm(const std::string& path, uid_t uid, gid_t gid) {
  if (mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::FailedPreconditionError(absl::StrCat("mkdir ", path, ": ", strerror(errno)));
  }
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " is not a folder"));
  }
  if (MountedAt(path)) return absl::OkStatus();
  const std::string options = absl::StrCat("mode=0700,uid=", uid, ",gid=", gid);
  if (mount("tmpfs", path.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, options.c_str()) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot mount the attempt's /dev/shm at ", path, ": ", strerror(errno)));
  }
  return absl::OkStatus();
}

bool UnmountAttemptShm(const std::string& path) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) return errno == ENOENT;
  // (Stacked mounts, from a worker that mounted again after a crash, go one at a time.)
  for (int i = 0; i < 16 && MountedAt(path); ++i) {
    if (umount2(path.c_str(), MNT_DETACH | UMOUNT_NOFOLLOW) != 0) return false;
  }
  return !MountedAt(path) && (rmdir(path.c_str()) == 0 || errno == ENOENT);
}

absl::Status MakeAttemptIpc(const std::string& path) {
  if (MountedAt(path)) return absl::OkStatus();  // (the attempt's other ranks here)
  const int file = open(path.c_str(), O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (file < 0) {
    return absl::FailedPreconditionError(absl::StrCat("cannot make ", path, ": ", strerror(errno)));
  }
  close(file);
  // A child makes the namespace and waits while it is bound here; then the mount keeps it.
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
    const int err = unshare(CLONE_NEWIPC) == 0 ? 0 : errno;
    (void)!write(made[1], &err, sizeof(err));
    char byte;
    (void)!read(done[0], &byte, 1);  // the worker's byte, or its end closed
    _exit(0);
  }
  close(made[1]);
  close(done[0]);
  int err = pid < 0 ? errno : 0;
  if (pid > 0 && read(made[0], &err, sizeof(err)) != sizeof(err)) err = ECHILD;
  std::string step = pid < 0 ? "fork" : "unshare";
  if (err == 0) {
    step = "mount";
    const std::string ns = absl::StrCat("/proc/", pid, "/ns/ipc");
    if (mount(ns.c_str(), path.c_str(), nullptr, MS_BIND, nullptr) != 0) err = errno;
  }
  (void)!write(done[1], "x", 1);
  close(made[0]);
  close(done[1]);
  if (pid > 0) {
    while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
  if (err != 0) {
    return absl::FailedPreconditionError(absl::StrCat("cannot make the attempt's IPC namespace at ",
                                                      path, ": ", step, ": ", strerror(err)));
  }
  return absl::OkStatus();
}

bool UnmountAttemptIpc(const std::string& path) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) return errno == ENOENT;
  for (int i = 0; i < 16 && MountedAt(path); ++i) {
    if (umount2(path.c_str(), MNT_DETACH | UMOUNT_NOFOLLOW) != 0) return false;
  }
  return !MountedAt(path) && (unlink(path.c_str()) == 0 || errno == ENOENT);
}

int EnterPrivateTmp(const char* tmp, const char* shm, const char* ipc, const char** step) {
  *step = "open the attempt's IPC namespace";
  const int ns = open(ipc, O_RDONLY | O_CLOEXEC);
  if (ns < 0) return errno;
  *step = "join the attempt's IPC namespace";
  const int joined = setns(ns, CLONE_NEWIPC);
  const int err = errno;
  close(ns);
  if (joined != 0) return err;
  *step = "unshare";
  if (unshare(CLONE_NEWNS) != 0) return errno;
  // The host's mounts reach the rank (a file system mounted later, say); its own reach nobody.
  *step = "make the mounts the host's slaves";
  if (mount("none", "/", nullptr, MS_REC | MS_SLAVE, nullptr) != 0) return errno;
  *step = "bind the attempt's tmp over /tmp";
  if (mount(tmp, "/tmp", nullptr, MS_BIND, nullptr) != 0) return errno;
  *step = "bind the attempt's shm over /dev/shm";
  if (mount(shm, "/dev/shm", nullptr, MS_BIND, nullptr) != 0) return errno;
  return 0;
}

}  // namespace trainyard::worker
