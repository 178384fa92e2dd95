// The job spec from YAML: a parser that reads any JobSpec field by reflection (names, units and
// shapes from spec_schema.cc's table), with file:line errors, and the file loaders. Defaults are
// in spec_defaults.cc, checks in spec_validate.cc.
#include "common/spec.h"

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/context_archive.h"
#include "common/spec_schema.h"
#include "common/status_macros.h"

namespace trainyard {

using google::protobuf::FieldDescriptor;
using v1::JobSpec;

namespace {

// Walks one YAML document into a message by reflection, recording field lines and reporting
// errors as FILE:LINE: message. Names, units, shapes and values given are read from the table.
class SpecParser {
 public:
  // `lines`: errors say the line of the file (false: YAML made from flags, whose lines mean
  // nothing to the user).
  SpecParser(const std::string& filename, ParsedSpec& out, bool lines = true)
      : filename_(filename), out_(out), lines_(lines) {}

  absl::Status Error(const YAML::Node& node, const std::string& message) const {
    if (!lines_) return absl::InvalidArgumentError(absl::StrCat(filename_, ": ", message));
    return absl::InvalidArgumentError(
        absl::StrCat(filename_, ":", node.Mark().line + 1, ": ", message));
  }

  // A mapping of YAML into `message`, whose path is `path` ("" for the spec itself).
  absl::Status Message(const YAML::Node& node, const std::string& path,
                       google::protobuf::Message& message) {
    if (!node.IsMap()) {
      return Error(node, absl::StrCat(path.empty() ? "the spec" : path, ": expected a mapping"));
    }
    // The names written in specs, each with its field; an old name is read as its new one's.
    const google::protobuf::Descriptor& d = *message.GetDescriptor();
    std::map<std::string, const FieldDescriptor*> fields;
    std::set<std::string> known;
    for (int i = 0; i < d.field_count(); ++i) {
      const std::string name = spec_schema::YamlName(path, *d.field(i));
      fields[name] = d.field(i);
      known.insert(name);
    }
    std::map<std::string, std::string> canonical;  // old name -> new
    for (const auto& kv : node) {
      const std::string key = kv.first.as<std::string>();
      const std::string field = Join(path, key);
      const spec_schema::Field* row = spec_schema::FindField(field);
      if (row != nullptr && !row->alias_of.empty()) {
        const std::string now(row->alias_of.substr(row->alias_of.rfind('.') + 1));
        if (node[now]) {
          return Error(kv.first, absl::StrCat(field, ": the old name of ", row->alias_of,
                                              ", which is given too: give one"));
        }
        canonical[key] = now;
      } else if (known.count(key) == 0) {
        return Error(kv.first, absl::StrCat("unknown field '", field,
                                            "' (known: ", absl::StrJoin(known, ", "), ")"));
      }
      out_.field_lines[Join(path, canonical.count(key) ? canonical[key] : key)] =
          kv.first.Mark().line + 1;
    }
    for (const auto& kv : node) {
      const std::string key = kv.first.as<std::string>();
      const std::string name = canonical.count(key) ? canonical[key] : key;
      RETURN_IF_ERROR(Value(kv.second, Join(path, key), spec_schema::FindField(Join(path, name)),
                            message, *fields.at(name)));
    }
    return absl::OkStatus();
  }

 private:
  // One field's YAML value; `field` is its path as written (an old name, maybe), `row` its row.
  absl::Status Value(const YAML::Node& node, const std::string& field,
                     const spec_schema::Field* row, google::protobuf::Message& message,
                     const FieldDescriptor& f) {
    const std::string shape = row != nullptr ? std::string(row->shape) : "";
    const google::protobuf::Reflection& r = *message.GetReflection();
    if (f.is_map()) {
      if (!node.IsMap()) {
        return Error(node, absl::StrCat(field, ": expected ", shape.empty() ? "a mapping" : shape));
      }
      const FieldDescriptor& key_field = *f.message_type()->map_key();
      const FieldDescriptor& value_field = *f.message_type()->map_value();
      for (const auto& kv : node) {
        std::string name, value;
        RETURN_IF_ERROR(Scalar(kv.first, field, name));
        RETURN_IF_ERROR(Scalar(kv.second, Join(field, name), value));
        google::protobuf::Message& entry = *r.AddMessage(&message, &f);
        RETURN_IF_ERROR(spec_schema::SetFromText(entry, key_field, nullptr, name));
        RETURN_IF_ERROR(spec_schema::SetFromText(entry, value_field, nullptr, value));
      }
      return absl::OkStatus();
    }
    if (f.is_repeated()) {
      if (!node.IsSequence() || (row != nullptr && row->non_empty && node.size() == 0)) {
        return Error(node, absl::StrCat(field, ": expected ", shape.empty() ? "a list" : shape));
      }
      for (const auto& item : node) {
        std::string text;
        RETURN_IF_ERROR(Scalar(item, field, text));
        if (absl::Status s = spec_schema::SetFromText(message, f, row, text); !s.ok()) {
          return Error(item, absl::StrCat(field, ": ", s.message()));
        }
      }
      return absl::OkStatus();
    }
    if (f.cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      return Message(node, field, *r.MutableMessage(&message, &f));  // sections are not renamed
    }
    std::string text;
    RETURN_IF_ERROR(Scalar(node, field, text));
    if (absl::Status s = spec_schema::SetFromText(message, f, row, text); !s.ok()) {
      return Error(node, absl::StrCat(field, ": ", s.message()));
    }
    // A value given where 0 would read as unset (and become the default), or where it means
    // "not given" later: checked here, on what the YAML says.
    if (row == nullptr) return absl::OkStatus();
    if (absl::Status s = spec_schema::CheckGiven(*row, message, f, text); !s.ok()) {
      return Error(node, absl::StrCat(field, ": ", s.message()));
    }
    return absl::OkStatus();
  }

  absl::Status Scalar(const YAML::Node& node, const std::string& field, std::string& text) {
    if (!node.IsScalar()) return Error(node, absl::StrCat(field, ": expected a scalar value"));
    text = node.Scalar();
    return absl::OkStatus();
  }

  static std::string Join(const std::string& path, const std::string& key) {
    return path.empty() ? key : absl::StrCat(path, ".", key);
  }

  std::string filename_;
  ParsedSpec& out_;
  bool lines_;
};

// The lists and maps that `node` gives, cleared in `message` (the parser appends to them): an
// override replaces them.
void ClearGivenCollections(const YAML::Node& node, const std::string& path,
                           google::protobuf::Message& message) {
  if (!node.IsMap()) return;
  const google::protobuf::Descriptor& d = *message.GetDescriptor();
  const google::protobuf::Reflection& r = *message.GetReflection();
  for (int i = 0; i < d.field_count(); ++i) {
    const FieldDescriptor& f = *d.field(i);
    const std::string name = spec_schema::YamlName(path, f);
    if (name.empty() || !node[name]) continue;
    if (f.is_repeated()) {
      r.ClearField(&message, &f);
    } else if (f.cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      ClearGivenCollections(node[name], path.empty() ? name : absl::StrCat(path, ".", name),
                            *r.MutableMessage(&message, &f));
    }
  }
}

// 1-based line of the innermost '{' or '[' that is never closed, or 0 if none is found. yaml-cpp
// reports an unclosed flow collection where it gave up (often the end of the file), not where the
// collection opened. A light scan: an opening bracket counts where a token may start (after the
// line start, ':', ',', '-', '[' or '{'); quoted scalars and comments are skipped.
int UnclosedFlowLine(const std::string& text) {
  std::vector<std::pair<char, int>> open;  // bracket, line
  int line = 1;
  char last = '\n';  // last character that is not a blank
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const bool after_blank =
        i == 0 || text[i - 1] == ' ' || text[i - 1] == '\t' || text[i - 1] == '\n';
    const bool token_start = std::string_view("\n:,-[{").find(last) != std::string_view::npos;
    if (c == '\n') {
      ++line;
      last = '\n';
    } else if (c == ' ' || c == '\t' || c == '\r') {
      continue;
    } else if (c == '#' && after_blank) {
      while (i + 1 < text.size() && text[i + 1] != '\n') ++i;
    } else if ((c == '\'' || c == '"') && token_start) {
      for (++i; i < text.size(); ++i) {
        if (text[i] == '\n') ++line;
        if (c == '"' && text[i] == '\\') {
          ++i;
        } else if (text[i] == c) {
          if (c == '\'' && i + 1 < text.size() && text[i + 1] == '\'') {
            ++i;  // '' is an escaped quote
          } else {
            break;
          }
        }
      }
      if (i >= text.size()) return 0;  // unterminated quote: a different error
      last = c;
    } else if ((c == '{' || c == '[') && token_start) {
      open.emplace_back(c, line);
      last = c;
    } else if ((c == '}' || c == ']') && !open.empty()) {
      open.pop_back();
      last = c;
    } else {
      last = c;
    }
  }
  return open.empty() ? 0 : open.back().second;
}

}  // namespace

absl::StatusOr<ParsedSpec> ParseJobSpecYaml(const std::string& yaml_text,
                                            const std::string& filename) {
  if (yaml_text.size() > kMaxSpecYamlBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        filename, ": ", yaml_text.size(), " bytes; a job spec is at most ", kMaxSpecYamlBytes));
  }
  ParsedSpec parsed;
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::ParserException& e) {
    int line = e.mark.line + 1;
    std::string message = e.msg;
    if (e.msg == YAML::ErrorMsg::END_OF_MAP_FLOW || e.msg == YAML::ErrorMsg::END_OF_SEQ_FLOW) {
      if (const int opened = UnclosedFlowLine(yaml_text); opened > 0) {
        line = opened;
        absl::StrAppend(&message, " (the ",
                        e.msg == YAML::ErrorMsg::END_OF_MAP_FLOW ? "'{'" : "'['",
                        " on this line is never closed)");
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat(filename, ":", line, ": malformed YAML: ", message));
  }
  if (!root || root.IsNull()) {
    return absl::InvalidArgumentError(absl::StrCat(filename, ":1: the spec is empty"));
  }
  SpecParser parser(filename, parsed);
  try {
    RETURN_IF_ERROR(parser.Message(root, "", parsed.spec));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(filename, ":", e.mark.line + 1, ": ", e.msg));
  }
  return parsed;
}

absl::Status OverrideJobSpecYaml(ParsedSpec& parsed, const std::string& yaml_text,
                                 const std::string& origin) {
  if (yaml_text.size() > kMaxSpecYamlBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        origin, ": ", yaml_text.size(), " bytes; a job spec is at most ", kMaxSpecYamlBytes));
  }
  ParsedSpec scratch;
  SpecParser parser(origin, scratch, /*lines=*/false);
  try {
    const YAML::Node root = YAML::Load(yaml_text);
    if (!root || root.IsNull()) return absl::OkStatus();
    ClearGivenCollections(root, "", parsed.spec);
    RETURN_IF_ERROR(parser.Message(root, "", parsed.spec));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": ", e.msg));
  }
  // What the file said of the fields set is not what the spec holds now (its sections stay).
  for (auto it = scratch.field_lines.begin(); it != scratch.field_lines.end(); ++it) {
    const auto next = std::next(it);
    const bool section = next != scratch.field_lines.end() &&
                         absl::StartsWith(next->first, absl::StrCat(it->first, "."));
    if (!section) parsed.field_lines.erase(it->first);
  }
  return absl::OkStatus();
}

absl::StatusOr<ParsedSpec> LoadJobSpecFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read the file"));
  // One byte more than allowed is enough to refuse it, without reading a huge file whole.
  std::string text(kMaxSpecYamlBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  return ParseJobSpecYaml(text, path);
}

absl::StatusOr<ParsedSpec> LoadValidJobSpecFile(const std::string& path,
                                                const std::string& overrides_yaml,
                                                const std::string& overrides_origin) {
  ASSIGN_OR_RETURN(ParsedSpec parsed, LoadJobSpecFile(path));
  RETURN_IF_ERROR(OverrideJobSpecYaml(parsed, overrides_yaml, overrides_origin));
  // In a file, a command job's relative workdir is the spec file's folder's (`workdir: .` runs
  // the program beside its spec), and so is its context's folder (`context: .` uploads the spec's
  // own folder); sent on, every workdir is absolute and every context a digest.
  JobSpec& spec = parsed.spec;
  auto from_file = [&path](std::string* folder) {
    if (folder->empty() || (*folder)[0] == '/') return;
    std::error_code ec;
    const std::filesystem::path base =
        std::filesystem::absolute(std::filesystem::path(path), ec).parent_path();
    if (!ec) *folder = (base / *folder).lexically_normal().string();
    if (folder->size() > 1 && folder->back() == '/') folder->pop_back();
  };
  if (IsCommandJob(spec)) {
    from_file(spec.mutable_workdir());
    if (!IsContextDigest(spec.context())) from_file(spec.mutable_context());
  }
  ApplyJobSpecDefaults(parsed.spec);
  if (absl::Status s = ValidateJobSpec(parsed.spec); !s.ok()) {
    return AnnotateWithLine(s, parsed, path);
  }
  return parsed;
}

absl::Status AnnotateWithLine(const absl::Status& status, const ParsedSpec& parsed,
                              const std::string& filename) {
  if (status.ok()) return status;
  const std::string message(status.message());
  const size_t colon = message.find(':');
  if (colon == std::string::npos) return status;
  std::string field = message.substr(0, colon);
  // The field itself may be absent (e.g. required); fall back to its closest present parent.
  while (!field.empty()) {
    auto it = parsed.field_lines.find(field);
    if (it != parsed.field_lines.end()) {
      return absl::Status(status.code(), absl::StrCat(filename, ":", it->second, ": ", message));
    }
    const size_t dot = field.rfind('.');
    field = dot == std::string::npos ? "" : field.substr(0, dot);
  }
  return absl::Status(status.code(), absl::StrCat(filename, ": ", message));
}

}  // namespace trainyard
