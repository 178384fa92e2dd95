// WriteParamDump / ReadParamDump (see param_dump.h).
#include "worker/trainer/io/param_dump.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace trainyard::trainer {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the dump format is little-endian");
constexpr char kMagic[8] = {'T', 'Y', 'P', 'D', 'U', 'M', 'P', '1'};

template <typename T>
void Put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

template <typename T>
bool Take(const std::string& in, size_t& pos, T* v) {
  if (in.size() - pos < sizeof(T)) return false;
  std::memcpy(v, in.data() + pos, sizeof(T));
  pos += sizeof(T);
  return true;
}

}  // namespace

absl::Status WriteParamDump(const std::string& path, std::vector<DumpedParam> params) {
  std::sort(params.begin(), params.end(),
            [](const DumpedParam& a, const DumpedParam& b) { return a.name < b.name; });
  std::string out(kMagic, sizeof(kMagic));
  Put<uint32_t>(out, static_cast<uint32_t>(params.size()));
  for (const DumpedParam& p : params) {
    Put<uint32_t>(out, static_cast<uint32_t>(p.name.size()));
    out += p.name;
    Put<uint32_t>(out, static_cast<uint32_t>(p.shape.size()));
    for (int64_t d : p.shape) Put<int64_t>(out, d);
    out.append(reinterpret_cast<const char*>(p.values.data()), p.values.size() * sizeof(float));
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(out.data(), static_cast<std::streamsize>(out.size()));
    if (!f) {
      return absl::InternalError(absl::StrCat("cannot write '", tmp, "': ", std::strerror(errno)));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot rename '", tmp, "' to '", path, "': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<DumpedParam>> ReadParamDump(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open '", path, "'"));
  std::string in((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto bad = [&path](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': ", why));
  };
  if (in.size() < sizeof(kMagic) || std::memcmp(in.data(), kMagic, sizeof(kMagic)) != 0) {
    return bad("not a trainyard parameter dump");
  }
  size_t pos = sizeof(kMagic);
  uint32_t count = 0;
  if (!Take(in, pos, &count)) return bad("truncated");
  std::vector<DumpedParam> params(count);
  for (DumpedParam& p : params) {
    uint32_t name_len = 0, ndim = 0;
    if (!Take(in, pos, &name_len) || in.size() - pos < name_len) return bad("truncated");
    p.name = in.substr(pos, name_len);
    pos += name_len;
    if (!Take(in, pos, &ndim)) return bad("truncated");
    int64_t numel = 1;
    for (uint32_t i = 0; i < ndim; ++i) {
      int64_t d = 0;
      if (!Take(in, pos, &d) || d < 0) return bad("truncated");
      p.shape.push_back(d);
      numel *= d;
    }
    const size_t bytes = static_cast<size_t>(numel) * sizeof(float);
    if (in.size() - pos < bytes) return bad("truncated");
    p.values.resize(numel);
    std::memcpy(p.values.data(), in.data() + pos, bytes);
    pos += bytes;
  }
  return params;
}

}  // namespace trainyard::trainer
