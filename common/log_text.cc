#include "common/log_text.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <memory>

namespace trainyard {
namespace {

constexpr char kHex[] = "0123456789abcdef";

template <typename Out>
void AppendEscaped(absl::string_view text, bool quote, Out& out) {
  for (const char ch : text) {
    const unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '\n':
        out.append("\\n", 2);
        continue;
      case '\r':
        out.append("\\r", 2);
        continue;
      case '\t':
        out.append("\\t", 2);
        continue;
      default:
        break;
    }
    if (c < 0x20 || c == 0x7f) {
      const char esc[4] = {'\\', 'x', kHex[c >> 4], kHex[c & 15]};
      out.append(esc, 4);
      continue;
    }
    if (quote && c == '\\') {
      out.append("\\\\", 2);
      continue;
    }
    if (quote && c == '"') {
      out.append("\\\"", 2);
      continue;
    }
    out.append(&ch, 1);
  }
}

// spdlog's default pattern with the message ("%v") replaced by its escaped form ("%*").
class EscapedPayload final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    struct Appender {
      spdlog::memory_buf_t& buf;
      void append(const char* p, size_t n) { buf.append(p, p + n); }
    } out{dest};
    AppendEscaped(absl::string_view(msg.payload.data(), msg.payload.size()), false, out);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<EscapedPayload>();
  }
};

}  // namespace

std::string EscapeControl(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  AppendEscaped(text, false, out);
  return out;
}

std::string Quoted(absl::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  out.push_back('"');
  AppendEscaped(text, true, out);
  out.push_back('"');
  return out;
}

std::unique_ptr<spdlog::formatter> EscapingFormatter() {
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  formatter->add_flag<EscapedPayload>('*').set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] %*");
  return formatter;
}

void InstallEscapingLogger(const std::string& name) {
  auto logger = spdlog::stderr_color_mt(name);
  logger->set_formatter(EscapingFormatter());
  spdlog::set_default_logger(std::move(logger));
}

std::string ValidUtf8(std::string text) {
  auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  std::string out;
  size_t i = 0;
  bool changed = false;
  while (i < text.size()) {
    const unsigned char c = byte(i);
    size_t len = c < 0x80           ? 1
                 : (c >> 5) == 0x6  ? 2
                 : (c >> 4) == 0xe  ? 3
                 : (c >> 3) == 0x1e ? 4
                                    : 0;
    bool ok = len > 0 && i + len <= text.size();
    for (size_t k = 1; ok && k < len; ++k) ok = (byte(i + k) & 0xc0) == 0x80;
    if (ok && len > 1) {  // no overlong forms, surrogates, or code points past U+10FFFF
      uint32_t cp = c & (0x7f >> len);
      for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (byte(i + k) & 0x3f);
      static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
      ok = cp >= kMin[len] && cp <= 0x10ffff && !(cp >= 0xd800 && cp <= 0xdfff);
    }
    if (ok) {
      out.append(text, i, len);
      i += len;
    } else {
      out += "\xef\xbf\xbd";
      ++i;
      changed = true;
    }
  }
  return changed ? out : text;
}

absl::string_view Utf8Prefix(absl::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  size_t n = max_bytes;
  while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xc0) == 0x80) --n;
  return text.substr(0, n);
}

}  // namespace trainyard
