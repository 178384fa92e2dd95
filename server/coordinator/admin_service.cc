// AdminService (admin.proto): the coordinator's state for its operators.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "common/credentials.h"
#include "common/grpc_status.h"
#include "server/coordinator/service_auth.h"
#include "server/coordinator/services.h"

namespace trainyard::coordinator {
namespace {

// A backup file, already unlinked, streamed from its descriptor in chunks of kChunkBytes, one read
// ahead of the client (the next chunk is read when the last one is written).
class BackupReactor final : public grpc::ServerWriteReactor<v1::BackupChunk> {
 public:
  static constexpr int64_t kChunkBytes = 1 << 20;

  BackupReactor(int fd, int64_t size) : fd_(fd), size_(size) { Next(); }
  ~BackupReactor() override { ::close(fd_); }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
      return;
    }
    Next();
  }
  void OnDone() override { delete this; }

 private:
  void Next() {
    if (offset_ >= size_ && sent_any_) {
      Finish(grpc::Status::OK);
      return;
    }
    const int64_t want = std::min(kChunkBytes, size_ - offset_);
    chunk_.Clear();
    chunk_.set_total_size(size_);
    chunk_.set_offset(offset_);
    if (!ReadAt(fd_, offset_, want, chunk_.mutable_data())) {
      Finish(grpc::Status(grpc::StatusCode::INTERNAL, "the backup file could not be read"));
      return;
    }
    offset_ += want;
    sent_any_ = true;
    StartWrite(&chunk_);
  }

  const int fd_;
  const int64_t size_;
  int64_t offset_ = 0;
  bool sent_any_ = false;
  v1::BackupChunk chunk_;
};

}  // namespace

grpc::ServerWriteReactor<v1::BackupChunk>* AdminServiceImpl::Backup(
    grpc::CallbackServerContext* ctx, const v1::BackupRequest* request) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) {
    return RejectStream<v1::BackupChunk>(ToGrpcStatus(s));
  }
  auto caller = AuthenticateAdmin(ctx, identities_, "Backup");
  if (!caller.ok()) return RejectStream<v1::BackupChunk>(ToGrpcStatus(caller.status()));
  // Made beside the database (same file system, same owner, mode 0600 as the file is private),
  // opened, then unlinked: only this stream can read it, and nothing stays behind.
  // (The copy runs on this gRPC thread: seconds for a large database, an admin's rare call.)
  const std::string path = absl::StrCat(scratch_dir_, "/backup-", Base64Url(RandomBytes(9)), ".db");
  absl::Status made = store_.Backup(path);
  int fd = -1;
  struct stat st {};
  if (made.ok()) {
    ::chmod(path.c_str(), 0600);
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0 || ::fstat(fd, &st) != 0) {
      made = absl::InternalError(absl::StrCat("cannot open the backup ", path));
    }
  }
  ::unlink(path.c_str());
  ::unlink((path + "-journal").c_str());  // (left only by a failed copy)
  Audit(*caller, "Backup", made.ok() ? absl::StrCat(st.st_size, " bytes") : "-", made);
  if (!made.ok()) {
    if (fd >= 0) ::close(fd);
    return RejectStream<v1::BackupChunk>(ToGrpcStatus(made));
  }
  return new BackupReactor(fd, st.st_size);
}

}  // namespace trainyard::coordinator
