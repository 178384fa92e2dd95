#include "common/field_limits.h"

#include <vector>

#include <google/protobuf/descriptor.h>

#include "absl/strings/str_cat.h"

namespace trainyard {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

std::string Join(absl::string_view root, absl::string_view name) {
  return root.empty() ? std::string(name) : absl::StrCat(root, ".", name);
}

absl::Status TooLong(const std::string& path, size_t size, size_t max) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", size, " bytes, at most ", max));
}

// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF),
// as protobuf requires of a `string` field: one that is not fails to parse on the other side.
bool IsUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t extra = 0;
    uint32_t cp = 0;
    if (c >= 0xc2 && c <= 0xdf) {
      extra = 1;
      cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
      extra = 2;
      cp = c & 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      extra = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + extra >= s.size()) return false;
    for (size_t k = 1; k <= extra; ++k) {
      const unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3f);
    }
    if ((extra == 2 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) ||
        (extra == 3 && (cp < 0x10000 || cp > 0x10ffff))) {
      return false;
    }
    i += extra + 1;
  }
  return true;
}

// A string field's value: within the length limit and, for `string` (not `bytes`), UTF-8.
absl::Status CheckString(const FieldDescriptor* f, const std::string& path, const std::string& v,
                         const FieldLimits& limits) {
  if (v.size() > limits.max_string_bytes) return TooLong(path, v.size(), limits.max_string_bytes);
  if (f->type() == FieldDescriptor::TYPE_STRING && !IsUtf8(v)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid UTF-8"));
  }
  return absl::OkStatus();
}

// A map entry's key as a path element, when it is a short printable string; else its index.
std::string EntryName(const Message& entry, int index) {
  const FieldDescriptor* key = entry.GetDescriptor()->FindFieldByNumber(1);
  if (key != nullptr && key->type() == FieldDescriptor::TYPE_STRING) {
    const std::string k = entry.GetReflection()->GetString(entry, key);
    bool printable = k.size() <= 64;
    for (char c : k) printable = printable && c > 0x20 && c < 0x7f && c != ']';
    if (printable) return k;
  }
  return absl::StrCat(index);
}

absl::Status Walk(const Message& m, const FieldLimits& limits, const std::string& root) {
  const Reflection* r = m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  for (const FieldDescriptor* f : fields) {
    const std::string path = Join(root, f->name());
    const bool is_string = f->cpp_type() == FieldDescriptor::CPPTYPE_STRING;
    const bool is_message = f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE;
    if (!f->is_repeated()) {
      if (is_string) {
        std::string scratch;
        const std::string& v = r->GetStringReference(m, f, &scratch);
        if (absl::Status s = CheckString(f, path, v, limits); !s.ok()) return s;
      } else if (is_message) {
        if (absl::Status s = Walk(r->GetMessage(m, f), limits, path); !s.ok()) return s;
      }
      continue;
    }
    const int n = r->FieldSize(m, f);
    if (static_cast<size_t>(n) > limits.max_repeated) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", n, " entries, at most ", limits.max_repeated));
    }
    for (int i = 0; i < n; ++i) {
      if (is_string) {
        std::string scratch;
        const std::string& v = r->GetRepeatedStringReference(m, f, i, &scratch);
        if (absl::Status s = CheckString(f, absl::StrCat(path, "[", i, "]"), v, limits); !s.ok()) {
          return s;
        }
      } else if (is_message) {
        const Message& e = r->GetRepeatedMessage(m, f, i);
        // A map's entry: its key and value are named by the key ("env[HOME]").
        const std::string element =
            absl::StrCat(path, "[", f->is_map() ? EntryName(e, i) : absl::StrCat(i), "]");
        if (f->is_map()) {
          std::vector<const FieldDescriptor*> kv;
          e.GetReflection()->ListFields(e, &kv);
          for (const FieldDescriptor* part : kv) {
            if (part->cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
              std::string scratch;
              const std::string& v = e.GetReflection()->GetStringReference(e, part, &scratch);
              if (absl::Status s = CheckString(
                      part, absl::StrCat(element, part->number() == 1 ? " (key)" : ""), v, limits);
                  !s.ok()) {
                return s;
              }
            } else if (part->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
              if (absl::Status s = Walk(e.GetReflection()->GetMessage(e, part), limits, element);
                  !s.ok()) {
                return s;
              }
            }
          }
        } else if (absl::Status s = Walk(e, limits, element); !s.ok()) {
          return s;
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckFieldSizes(const Message& message, const FieldLimits& limits,
                             absl::string_view root) {
  // Field by field first, so that one oversized field is named.
  if (absl::Status s = Walk(message, limits, std::string(root)); !s.ok()) return s;
  const size_t bytes = message.ByteSizeLong();
  if (bytes > limits.max_message_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(root.empty() ? "request" : root, ": ", bytes,
                                                   " bytes serialized, at most ",
                                                   limits.max_message_bytes));
  }
  return absl::OkStatus();
}

}  // namespace trainyard
