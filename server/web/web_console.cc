#include "server/web/web_console.h"

#include <arpa/inet.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "common/status_macros.h"
#include "common/tls.h"
#include "rpc/ps/tls_io.h"
#include "server/web/event_queue.h"
#include "server/web/guarded_http_server.h"
#include "server/web/web_assets.h"
#include "trainyard/v1/identity.grpc.pb.h"
#include "trainyard/v1/job.grpc.pb.h"
#include "trainyard/v1/node.grpc.pb.h"

namespace trainyard::web {
namespace {

namespace v1 = ::trainyard::v1;
using httplib::Request;
using httplib::Response;

}  // namespace

absl::StatusOr<std::string> WebPublicOrigin(const std::string& url) {
  if (url.empty()) return std::string();
  auto bad = [&url](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("--web-public-url: '",
                                                   absl::CHexEscape(url.substr(0, 256)), "' ", why,
                                                   " (expected https://HOST[:PORT])"));
  };
  if (url.size() > 256) return bad("is longer than 256 bytes");
  std::string rest = absl::AsciiStrToLower(url);
  std::string scheme;
  for (const char* s : {"https://", "http://"}) {
    if (absl::StartsWith(rest, s)) scheme = s;
  }
  if (scheme.empty()) return bad("is not an http:// or https:// URL");
  rest = rest.substr(scheme.size());
  if (absl::EndsWith(rest, "/")) rest.pop_back();
  if (rest.empty() || rest.find_first_of("/?#@\\ \t\r\n") != std::string::npos) {
    return bad("is not a scheme, host and port only (the console is served at the root)");
  }
  std::string host = rest, port;
  if (const size_t colon = rest.rfind(':');
      colon != std::string::npos && rest.find(']', colon) == std::string::npos) {
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
    int number = 0;
    if (port.empty() || port.size() > 5 || !absl::c_all_of(port, absl::ascii_isdigit) ||
        !absl::SimpleAtoi(port, &number) || number < 1 || number > 65535) {
      return bad("has no port number after its ':'");
    }
    port = absl::StrCat(number);  // (no leading zeros: as a browser writes it)
  }
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) {
    in6_addr v6{};
    char out[INET6_ADDRSTRLEN] = {0};
    const std::string inside = host.substr(1, host.size() - 2);
    if (inet_pton(AF_INET6, inside.c_str(), &v6) != 1) return bad("has no host name or address");
    host = absl::StrCat("[", inet_ntop(AF_INET6, &v6, out, sizeof(out)), "]");
  } else if (host.empty() || !absl::c_all_of(host, [](char c) {
               return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-';
             })) {
    return bad("has no host name or address");
  }
  if ((scheme == "https://" && port == "443") || (scheme == "http://" && port == "80")) {
    port.clear();
  }
  return absl::StrCat(scheme, host, port.empty() ? "" : ":", port);
}

namespace {

// The session cookie: under TLS with the __Host- prefix (Secure, Path=/, this host only: no
// subdomain can set one).
constexpr char kCookie[] = "ty_session";
constexpr char kTlsCookie[] = "__Host-ty_session";
// Answers are never compressed: cpp-httplib compresses "application/json" and "text/..." (but
// not these spellings) with Brotli's slowest quality, some 200 ms for the charting library.
// Loopback and a LAN do not need it.
constexpr char kJson[] = "application/json; charset=utf-8";
constexpr char kCsrfHeader[] = "X-CSRF-Token";
constexpr size_t kMaxBody = 64 << 10;   // a request's body: sign-in, cancel, cordon
constexpr int kMaxLogLines = 100000;    // GET .../logs?tail=
constexpr size_t kMaxSteps = 100000;    // GET .../metrics
constexpr int kFilterScanJobs = 10000;  // name/account filters look at most this far a page
constexpr int kStreamsPerCaller = 8;    // live streams of one user (or token) at once
constexpr absl::Duration kLinkLifetime = absl::Minutes(1);  // yard web's link
constexpr char kIdPattern[] = "([A-Za-z0-9][A-Za-z0-9._:-]{0,127})";

// Every answer's headers: the pages run only their own scripts and styles, fetch only from here,
// are never framed, and nothing is sniffed or cached.
httplib::Headers SecurityHeaders() {
  return {
      {"Content-Security-Policy",
       "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"},
      {"X-Content-Type-Options", "nosniff"},
      {"X-Frame-Options", "DENY"},
      {"Referrer-Policy", "no-referrer"},
      {"Cache-Control", "no-store"},
      {"Cross-Origin-Opener-Policy", "same-origin"},
      {"Cross-Origin-Resource-Policy", "same-origin"},
  };
}

int HttpStatus(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return 200;
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::OUT_OF_RANGE:
      return 400;
    case grpc::StatusCode::UNAUTHENTICATED:
      return 401;
    case grpc::StatusCode::PERMISSION_DENIED:
      return 403;
    case grpc::StatusCode::NOT_FOUND:
      return 404;
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::FAILED_PRECONDITION:
      return 409;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return 429;
    case grpc::StatusCode::UNIMPLEMENTED:
      return 501;
    case grpc::StatusCode::UNAVAILABLE:
      return 503;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return 504;
    default:
      return 500;
  }
}

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "INTERNAL";
  }
}

std::string Dump(const nlohmann::json& j) {
  // Text from jobs may hold invalid UTF-8: replaced, never a thrown exception.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void Fail(Response& res, grpc::StatusCode code, const std::string& message) {
  res.status = HttpStatus(code);
  res.set_content(Dump({{"error", {{"code", CodeName(code)}, {"message", message}}}}), kJson);
}

std::string ToJson(const google::protobuf::Message& m) {
  google::protobuf::util::JsonPrintOptions options;
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(m, &out, options).ok()) return "{}";
  return out;
}

// The request's body into `m` (protobuf's JSON mapping; an empty body is an empty message); false
// with the answer written when it does not parse.
bool ParseBody(const Request& req, google::protobuf::Message* m, Response& res) {
  if (req.body.empty()) return true;
  google::protobuf::util::JsonParseOptions options;
  const auto status = google::protobuf::util::JsonStringToMessage(req.body, m, options);
  if (!status.ok()) {
    Fail(res, grpc::StatusCode::INVALID_ARGUMENT,
         absl::StrCat("body: not a ", m->GetDescriptor()->name(),
                      " in JSON: ", std::string(status.message())));
    return false;
  }
  return true;
}

// The value of cookie `name` in the request's Cookie headers; empty when absent.
std::string CookieValue(const Request& req, absl::string_view name) {
  const size_t count = req.get_header_value_count("Cookie");
  for (size_t i = 0; i < count; ++i) {
    for (absl::string_view part : absl::StrSplit(req.get_header_value("Cookie", i), ';')) {
      part = absl::StripAsciiWhitespace(part);
      if (absl::ConsumePrefix(&part, name) && absl::ConsumePrefix(&part, "=")) {
        return std::string(part);
      }
    }
  }
  return "";
}

std::string Lower(absl::string_view s) { return absl::AsciiStrToLower(s); }

// A live stream: its queue, the gRPC calls feeding it and their threads. When the last producer
// returns, an "end" event ends it (the page closes its EventSource rather than reconnecting).
// Closed (calls cancelled, threads joined, `on_close` run) by the HTTP side when the browser goes
// or the console stops.
class LiveStream {
 public:
  explicit LiveStream(std::function<void()> on_close) : on_close_(std::move(on_close)) {}
  ~LiveStream() { Close(); }

  EventQueue& queue() { return queue_; }

  // A gRPC call of this stream, with `metadata` (the caller's): cancelled at Close.
  grpc::ClientContext* NewContext(
      const std::vector<std::pair<std::string, std::string>>& metadata) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    for (const auto& [key, value] : metadata) ctx->AddMetadata(key, value);
    absl::MutexLock lock(&mu_);
    contexts_.push_back(std::move(ctx));
    return contexts_.back().get();
  }
  // A producer on a thread of its own (the HTTP thread that made the stream calls this).
  void Run(std::function<void()> producer) {
    running_.fetch_add(1);
    threads_.emplace_back([this, producer = std::move(producer)] {
      producer();
      Returned();
    });
  }
  // Every producer is running: the stream ends when the last returns.
  void Started() { Returned(); }

  // A thread that asks, while the stream is open, whether its caller may still read it, and
  // ends it with Refuse when not (it returns then, or once the stream is closed). Not a
  // producer: the stream ends without it. Joined at Close.
  void Guard(std::function<void()> guard) { guard_ = std::thread(std::move(guard)); }

  // Ends the stream with a "refused" event ({code, message}): nothing its producers push after it
  // reaches the page, and its calls are cancelled.
  void Refuse(const grpc::Status& s) {
    queue_.Seal("refused",
                Dump({{"code", CodeName(s.error_code())}, {"message", s.error_message()}}));
    absl::MutexLock lock(&mu_);
    for (auto& ctx : contexts_) ctx->TryCancel();
  }

  void Close() {
    if (closed_.exchange(true)) return;
    queue_.Close();
    {
      absl::MutexLock lock(&mu_);
      for (auto& ctx : contexts_) ctx->TryCancel();
    }
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
    if (guard_.joinable()) guard_.join();
    if (on_close_) on_close_();
  }

 private:
  void Returned() {
    if (running_.fetch_sub(1) == 1) {
      queue_.Push("end", "{}");
      queue_.End();
    }
  }

  const std::function<void()> on_close_;
  std::atomic<bool> closed_{false};
  std::atomic<int> running_{1};  // producers, and 1 until Started()
  EventQueue queue_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;  // started and joined by the HTTP threads only
  std::thread guard_;                 // (as threads_)
};

// Who is calling: a program's bearer token, or a browser's session.
struct Caller {
  std::string token;
  std::optional<WebSession> session;
  std::string session_id;  // the session's cookie value
  std::string client;      // the browser's address (its failed sign-ins count under it)
};

}  // namespace

struct WebConsole::Impl {
  WebConsoleOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::JobService::Stub> jobs;
  std::unique_ptr<v1::NodeService::Stub> nodes;
  std::unique_ptr<v1::IdentityService::Stub> identity;
  std::unique_ptr<GuardedHttpServer> server;
  std::thread listener;
  std::string url;
  std::string public_origin;  // public_url's scheme, host and port: an Origin header's form
  std::string bound_url;      // the console's own address, "http(s)://HOST:PORT"
  std::vector<std::string> trusted_proxies;  // in CanonicalAddress's form
  bool tls = false;
  WebSessions sessions{WebSessionLimits{}};
  absl::Mutex streams_mu;
  int open_streams ABSL_GUARDED_BY(streams_mu) = 0;
  std::map<std::string, int> streams_by_caller ABSL_GUARDED_BY(streams_mu);
  std::atomic<bool> stopping{false};

  explicit Impl(const WebConsoleOptions& o) : options(o), sessions(o.sessions) {}

  // Whether browsers reach the console over HTTPS: its own TLS, or a proxy's (public_url).
  bool secure() const { return tls || absl::StartsWith(public_origin, "https://"); }
  const char* cookie() const { return secure() ? kTlsCookie : kCookie; }

  // The browser's address: the peer's, or, from a trusted proxy, the last entry of the last
  // X-Forwarded-For line (the address that proxy saw, whether it appended to the browser's line
  // or added one of its own; what a browser wrote before it is not believed). Addresses compared
  // in one form (an IPv4 peer of a dual-stack socket reads ::ffff:A.B.C.D).
  std::string ClientOf(const Request& req) const {
    const std::optional<std::string> peer = CanonicalAddress(req.remote_addr);
    if (peer.has_value() && absl::c_linear_search(trusted_proxies, *peer)) {
      const size_t lines = req.get_header_value_count("X-Forwarded-For");
      const std::string forwarded =
          lines == 0 ? "" : req.get_header_value("X-Forwarded-For", lines - 1);
      std::vector<absl::string_view> hops = absl::StrSplit(forwarded, ',');
      if (std::optional<std::string> last =
              CanonicalAddress(std::string(absl::StripAsciiWhitespace(hops.back())));
          last.has_value()) {
        return *last;
      }
    }
    return req.remote_addr;
  }

  // --- who calls ---

  // The caller of `req`, or false with the refusal written. `action`: the request changes
  // something, so a browser's session must prove it came from this console's own page.
  bool Identify(const Request& req, Response& res, bool action, Caller* caller) {
    caller->client = ClientOf(req);
    const std::string auth = req.get_header_value("Authorization");
    if (!auth.empty()) {
      absl::string_view v = auth;
      if (!absl::ConsumePrefix(&v, "Bearer ") || v.empty() || v.size() > 1024) {
        Fail(res, grpc::StatusCode::UNAUTHENTICATED,
             "Authorization: expected \"Bearer <API token>\"");
        return false;
      }
      caller->token = std::string(v);
      return true;
    }
    const std::string id = CookieValue(req, cookie());
    std::optional<WebSession> session = id.empty() ? std::nullopt : sessions.Find(id);
    if (!session.has_value()) {
      Fail(res, grpc::StatusCode::UNAUTHENTICATED,
           "not signed in: POST /api/v1/session with an API token, or send "
           "\"Authorization: Bearer <API token>\"");
      return false;
    }
    if (action) {
      if (!SameOrigin(req)) {
        Fail(res, grpc::StatusCode::PERMISSION_DENIED,
             "Origin: a request from another site may not act with this session");
        return false;
      }
      if (!ConstantTimeEquals(req.get_header_value(kCsrfHeader), session->csrf)) {
        Fail(res, grpc::StatusCode::PERMISSION_DENIED,
             "X-CSRF-Token: missing or wrong (the console's pages send it; see GET "
             "/api/v1/session)");
        return false;
      }
    }
    caller->token = session->token;
    caller->session = std::move(session);
    caller->session_id = id;
    return true;
  }

  // Where the browser says the request came from (Origin, Sec-Fetch-Site), if it says: this
  // console's own origin.
  bool SameOrigin(const Request& req) const {
    const std::string site = req.get_header_value("Sec-Fetch-Site");
    if (!site.empty() && site != "same-origin" && site != "none") return false;
    const std::string origin = req.get_header_value("Origin");
    if (origin.empty()) return true;
    // Behind a proxy: its origin, or the console's own bound address (direct use); never one
    // made of the Host the proxy passed on.
    if (!public_origin.empty()) return origin == public_origin || origin == bound_url;
    const std::string host = req.get_header_value("Host");
    return !host.empty() && origin == absl::StrCat(tls ? "https://" : "http://", host);
  }

  // The metadata of a call for `caller`: its token, and (to the coordinator, with the console's
  // key) the browser's address.
  std::vector<std::pair<std::string, std::string>> Metadata(const Caller& caller) const {
    std::vector<std::pair<std::string, std::string>> out = {
        {kAuthorizationMetadata, "Bearer " + caller.token}};
    if (!options.console_key.empty()) {
      out.emplace_back(kConsoleKeyMetadata, options.console_key);
      out.emplace_back(kConsoleClientMetadata, caller.client);
    }
    return out;
  }

  std::unique_ptr<grpc::ClientContext> Context(const Caller& caller,
                                               absl::Duration deadline = absl::Seconds(30)) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    for (const auto& [key, value] : Metadata(caller)) ctx->AddMetadata(key, value);
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    return ctx;
  }

  // Answers with `m` for an OK status, else the error; a token that no longer authenticates
  // ends its sessions.
  void Answer(const Caller& caller, const grpc::Status& status, const google::protobuf::Message& m,
              Response& res) {
    if (status.ok()) {
      res.set_content(ToJson(m), kJson);
      return;
    }
    Refusal(caller, status, res);
  }
  void Refusal(const Caller& caller, const grpc::Status& status, Response& res) {
    if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      sessions.RemoveToken(caller.token);
    }
    Fail(res, status.error_code(), status.error_message());
  }

  // --- sessions ---

  void SignIn(const Request& req, Response& res) {
    if (!SameOrigin(req)) {
      Fail(res, grpc::StatusCode::PERMISSION_DENIED,
           "Origin: sign in from this console's own page");
      return;
    }
    nlohmann::json body = nlohmann::json::parse(req.body, nullptr, /*allow_exceptions=*/false);
    Caller caller;
    caller.client = ClientOf(req);
    if (body.is_object() && body.contains("code") && body["code"].is_string()) {
      std::optional<std::string> token = sessions.TakeCode(body["code"].get<std::string>());
      if (!token.has_value()) {
        Fail(res, grpc::StatusCode::UNAUTHENTICATED,
             "code: unknown, used or expired (a link from yard web is good once, for a minute)");
        return;
      }
      caller.token = *std::move(token);
    } else if (body.is_object() && body.contains("token") && body["token"].is_string()) {
      caller.token = body["token"].get<std::string>();
    } else {
      Fail(res, grpc::StatusCode::INVALID_ARGUMENT,
           "token: expected {\"token\": \"tyt....\"} (or {\"code\": ...} from yard web)");
      return;
    }
    if (caller.token.empty() || caller.token.size() > 1024) {
      Fail(res, grpc::StatusCode::INVALID_ARGUMENT, "token: empty or longer than 1024 bytes");
      return;
    }
    v1::WhoAmIResponse who;
    auto ctx = Context(caller);
    grpc::Status s = identity->WhoAmI(ctx.get(), v1::WhoAmIRequest(), &who);
    if (!s.ok()) {
      Fail(res, s.error_code(), s.error_message());
      return;
    }
    if (who.user().empty()) {
      Fail(res, grpc::StatusCode::PERMISSION_DENIED,
           "token: only a user's API token signs in (this is a node's or a job's credential)");
      return;
    }
    const bool admin = who.role() == v1::ADMIN;
    const std::string id = sessions.Create(caller.token, who.user(), admin);
    res.set_header("Set-Cookie",
                   absl::StrCat(cookie(), "=", id, "; Path=/; HttpOnly; SameSite=Strict",
                                secure() ? "; Secure" : ""));
    std::optional<WebSession> session = sessions.Find(id);
    res.set_content(Dump({{"user", who.user()},
                          {"admin", admin},
                          {"csrfToken", session.has_value() ? session->csrf : ""}}),
                    kJson);
  }

  // POST /api/v1/session/link (a bearer token; yard web): a link that signs a browser in once,
  // within a minute, as the token's user.
  void SignInLink(const Request& req, Response& res) {
    if (req.get_header_value("Authorization").empty()) {
      Fail(res, grpc::StatusCode::UNAUTHENTICATED,
           "Authorization: a sign-in link is made with \"Bearer <API token>\" (yard web)");
      return;
    }
    Caller caller;
    if (!Identify(req, res, false, &caller)) return;
    v1::WhoAmIResponse who;
    auto ctx = Context(caller);
    grpc::Status s = identity->WhoAmI(ctx.get(), v1::WhoAmIRequest(), &who);
    if (!s.ok()) return Refusal(caller, s, res);
    if (who.user().empty()) {
      Fail(res, grpc::StatusCode::PERMISSION_DENIED,
           "token: only a user's API token signs in (this is a node's or a job's credential)");
      return;
    }
    const std::string code = sessions.CreateCode(caller.token, who.user(), kLinkLifetime);
    const std::string host = req.get_header_value("Host");
    // (Behind a proxy, the URL browsers reach: the Host here may be the proxy's upstream.)
    const std::string base = !public_origin.empty() || host.empty() || host.size() > 256 ||
                                     host.find_first_of("/#?@ \\") != std::string::npos
                                 ? url
                                 : absl::StrCat(tls ? "https://" : "http://", host);
    res.set_content(Dump({{"url", absl::StrCat(base, "/#/signin?code=", code)},
                          {"user", who.user()},
                          {"expiresInSeconds", absl::ToInt64Seconds(kLinkLifetime)}}),
                    kJson);
  }

  void Session(const Request& req, Response& res) {
    const std::string id = CookieValue(req, cookie());
    std::optional<WebSession> session = id.empty() ? std::nullopt : sessions.Find(id);
    if (!session.has_value()) {
      Fail(res, grpc::StatusCode::UNAUTHENTICATED, "not signed in");
      return;
    }
    res.set_content(
        Dump({{"user", session->user}, {"admin", session->admin}, {"csrfToken", session->csrf}}),
        kJson);
  }

  void SignOut(const Request& req, Response& res) {
    Caller caller;
    if (!Identify(req, res, /*action=*/true, &caller)) return;
    sessions.Remove(CookieValue(req, cookie()));
    res.set_header("Set-Cookie", absl::StrCat(cookie(),
                                              "=; Path=/; Max-Age=0; HttpOnly; "
                                              "SameSite=Strict",
                                              secure() ? "; Secure" : ""));
    res.set_content("{}", kJson);
  }

  // --- jobs ---

  // GET /api/v1/jobs?state=RUNNING&state=...&owner=&name=&account=&page_size=&page_token=
  void ListJobs(const Request& req, Response& res) {
    Caller caller;
    if (!Identify(req, res, false, &caller)) return;
    v1::ListJobsRequest r;
    std::string name, account;
    if (!ListRequest(req, res, &r, &name, &account)) return;
    v1::ListJobsResponse page;
    grpc::Status s = List(caller, r, name, account, &page);
    Answer(caller, s, page, res);
  }

  bool ListRequest(const Request& req, Response& res, v1::ListJobsRequest* r, std::string* name,
                   std::string* account) {
    for (size_t i = 0; i < req.get_param_value_count("state"); ++i) {
      v1::JobState state;
      const std::string text = req.get_param_value("state", i);
      if (!v1::JobState_Parse(absl::AsciiStrToUpper(text), &state) ||
          state == v1::JOB_STATE_UNSPECIFIED) {
        Fail(res, grpc::StatusCode::INVALID_ARGUMENT,
             absl::StrCat("state: unknown job state '", text.substr(0, 64), "'"));
        return false;
      }
      r->add_states(state);
    }
    r->set_owner(req.get_param_value("owner"));
    r->set_page_token(req.get_param_value("page_token"));
    const std::string size = req.get_param_value("page_size");
    int page_size = 0;
    if (!size.empty() &&
        (!absl::SimpleAtoi(size, &page_size) || page_size < 0 || page_size > 1000)) {
      Fail(res, grpc::StatusCode::INVALID_ARGUMENT, "page_size: expected 0..1000");
      return false;
    }
    r->set_page_size(page_size);
    r->set_why_waiting(req.get_param_value("why_waiting") == "true");
    *name = Lower(req.get_param_value("name"));
    *account = req.get_param_value("account");
    if (name->size() > 256 || account->size() > 256) {
      Fail(res, grpc::StatusCode::INVALID_ARGUMENT, "name, account: at most 256 bytes");
      return false;
    }
    // (A filter reads up to kFilterScanJobs jobs; each one's reason looks at the whole queue.)
    if (r->why_waiting() && (!name->empty() || !account->empty())) {
      Fail(res, grpc::StatusCode::INVALID_ARGUMENT,
           "why_waiting: not with a name or account filter");
      return false;
    }
    return true;
  }

  // One page of ListJobs; with a name or account filter, pages of the unfiltered list are read
  // until `page_size` jobs match or kFilterScanJobs were looked at (then a shorter page, with the
  // token to go on from).
  grpc::Status List(const Caller& caller, const v1::ListJobsRequest& r, const std::string& name,
                    const std::string& account, v1::ListJobsResponse* out,
                    EventQueue* reader = nullptr) {
    if (name.empty() && account.empty()) {
      auto ctx = Context(caller);
      return jobs->ListJobs(ctx.get(), r, out);
    }
    const int want = r.page_size() == 0 ? 100 : r.page_size();
    v1::ListJobsRequest scan = r;
    scan.set_page_size(1000);
    int looked = 0;
    while (true) {
      v1::ListJobsResponse part;
      auto ctx = Context(caller);
      grpc::Status s = jobs->ListJobs(ctx.get(), scan, &part);
      if (!s.ok()) return s;
      for (const v1::Job& job : part.jobs()) {
        ++looked;
        if ((account.empty() || job.account() == account) &&
            (name.empty() || absl::StrContains(Lower(job.spec().name()), name))) {
          *out->add_jobs() = job;
          if (out->jobs_size() == want) {
            // The list's token is the sequence number to continue below.
            out->set_next_page_token(absl::StrCat(job.seq()));
            return grpc::Status::OK;
          }
        }
      }
      if (part.next_page_token().empty()) return grpc::Status::OK;
      if (reader != nullptr && reader->closed()) {  // (a live list whose page left)
        return grpc::Status(grpc::StatusCode::CANCELLED, "the reader left");
      }
      scan.set_page_token(part.next_page_token());
      if (looked >= kFilterScanJobs) {
        out->set_next_page_token(part.next_page_token());
        return grpc::Status::OK;
      }
    }
  }

  void GetJob(const Request& req, Response& res) {
    Caller caller;
    if (!Identify(req, res, false, &caller)) return;
    v1::GetJobRequest r;
    r.set_job_id(req.matches[1]);
    v1::Job job;
    auto ctx = Context(caller);
    Answer(caller, jobs->GetJob(ctx.get(), r, &job), job, res);
  }

  // GET /api/v1/jobs/ID/logs?tail=N: {"lines": [LogLine...]}, the last N kept (default 1000),
  // written as they are read (a job keeps up to 64 MiB of log, up to six times that in JSON: the
  // whole answer was built, then copied, in memory). The first line decides the status; a read
  // that fails after it ends the answer with "error": {code, message}.
  void Logs(const Request& req, Response& res) {
    Caller caller;
    if (!Identify(req, res, false, &caller)) return;
    v1::StreamLogsRequest r;
    r.set_job_id(req.matches[1]);
    int tail = 1000;
    const std::string t = req.get_param_value("tail");
    if (!t.empty() && (!absl::SimpleAtoi(t, &tail) || tail < 1 || tail > kMaxLogLines)) {
      Fail(res, grpc::StatusCode::INVALID_ARGUMENT,
           absl::StrCat("tail: expected 1..", kMaxLogLines));
      return;
    }
    r.set_tail(tail);
    auto lines = std::make_shared<LogLines>();
    lines->ctx = Context(caller, absl::Minutes(5));  // (a slow reader takes its time)
    lines->reader = jobs->StreamLogs(lines->ctx.get(), r);
    v1::LogLine first;
    if (!lines->reader->Read(&first)) {
      const grpc::Status s = lines->reader->Finish();
      lines->finished = true;
      if (!s.ok()) return Refusal(caller, s, res);
      res.set_content("{\"lines\":[]}", kJson);
      return;
    }
    lines->pending = ToJson(first);
    WriteArray(res, "lines", lines);
  }

  // GET /api/v1/jobs/ID/metrics: {"steps": [StepReport...]}, the newest kMaxSteps kept, and
  // "omitted": how many older ones were left out (if any).
  void Metrics(const Request& req, Response& res) {
    Caller caller;
    if (!Identify(req, res, false, &caller)) return;
    v1::StreamMetricsRequest r;
    r.set_job_id(req.matches[1]);
    auto ctx = Context(caller);
    auto reader = jobs->StreamMetrics(ctx.get(), r);
    auto steps = std::make_shared<Steps>();
    v1::StepReport step;
    while (reader->Read(&step)) {
      steps->json.push_back(ToJson(step));
      if (steps->json.size() > kMaxSteps) {
        steps->json.pop_front();
        ++steps->omitted;
      }
    }
    grpc::Status s = reader->Finish();
    if (!s.ok()) return Refusal(caller, s, res);
    WriteArray(res, "steps", steps);
  }

  // An answer's array, element by element (JSON), then what follows it in the object.
  class ArraySource {
   public:
    virtual ~ArraySource() = default;
    // The next element into `json`; false when there are no more.
    virtual bool Next(std::string* json) = 0;
    // What follows the array (",\"key\":value..."), once Next said there are no more.
    virtual std::string After() { return ""; }
    // The answer ended (written or not).
    virtual void Release() {}
  };

  // A log stream's lines (Logs).
  struct LogLines final : ArraySource {
    std::unique_ptr<grpc::ClientContext> ctx;
    std::unique_ptr<grpc::ClientReader<v1::LogLine>> reader;
    std::string pending;  // the first line, read to decide the status
    grpc::Status status;
    bool finished = false;

    bool Next(std::string* json) override {
      if (!pending.empty()) {
        *json = std::move(pending);
        pending.clear();
        return true;
      }
      if (finished) return false;
      v1::LogLine line;
      if (reader->Read(&line)) {
        *json = ToJson(line);
        return true;
      }
      status = reader->Finish();
      finished = true;
      return false;
    }
    std::string After() override {
      if (status.ok()) return "";
      return absl::StrCat(",\"error\":", Dump({{"code", CodeName(status.error_code())},
                                               {"message", status.error_message()}}));
    }
    void Release() override {
      if (finished) return;
      ctx->TryCancel();  // the browser went: the stream ends with it
      v1::LogLine line;
      while (reader->Read(&line)) {
      }
      reader->Finish();
      finished = true;
    }
  };

  // Step reports read whole, the newest kMaxSteps (Metrics).
  struct Steps final : ArraySource {
    std::deque<std::string> json;
    size_t omitted = 0;

    bool Next(std::string* out) override {
      if (json.empty()) return false;
      *out = std::move(json.front());
      json.pop_front();
      return true;
    }
    std::string After() override {
      return omitted == 0 ? "" : absl::StrCat(",\"omitted\":", omitted);
    }
  };

  // Answers {"KEY": [elements of `source`]...}, written in chunks of about kWriteBytes as the
  // elements come.
  static void WriteArray(Response& res, const std::string& key,
                         std::shared_ptr<ArraySource> source) {
    constexpr size_t kWriteBytes = 256 << 10;
    auto began = std::make_shared<bool>(false);
    res.set_chunked_content_provider(
        kJson,
        [source, key, began](size_t, httplib::DataSink& sink) {
          std::string out;
          if (!*began) out = absl::StrCat("{\"", key, "\":[");
          std::string element;
          bool more = true;
          while (out.size() < kWriteBytes && (more = source->Next(&element))) {
            if (*began) out += ",";
            *began = true;
            out += element;
          }
          *began = true;
          if (!more) absl::StrAppend(&out, "]", source->After(), "}");
          if (!sink.write(out.data(), out.size())) return false;
          if (!more) sink.done();
          return true;
        },
        [source](bool) { source->Release(); });
  }

  void Cancel(const Request& req, Response& res) {
    Caller caller;
    if (!Identify(req, res, true, &caller)) return;
    v1::CancelJobRequest r;
    if (!ParseBody(req, &r, res)) return;
    r.set_job_id(req.matches[1]);
    if (r.reason().empty()) r.set_reason("cancelled from the web console");
    v1::Job job;
    auto ctx = Context(caller);
    Answer(caller, jobs->CancelJob(ctx.get(), r, &job), job, res);
  }

  void Checkpoint(const Request& req, Response& res) {
    Caller caller;
    if (!Identify(req, res, true, &caller)) return;
    v1::CheckpointJobRequest r;
    r.set_job_id(req.matches[1]);
    v1::Job job;
    auto ctx = Context(caller);
    Answer(caller, jobs->CheckpointJob(ctx.get(), r, &job), job, res);
  }

  // --- the cluster ---

  void ListNodes(const Request& req, Response& res) {
    Caller caller;
    if (!Identify(req, res, false, &caller)) return;
    v1::ListNodesResponse nodes_out;
    auto ctx = Context(caller);
    Answer(caller, nodes->ListNodes(ctx.get(), v1::ListNodesRequest(), &nodes_out), nodes_out, res);
  }

  // POST /api/v1/nodes/ID/cordon {"action": "CORDON" | "UNCORDON" | "DRAIN", "reason": "..."}
  void Cordon(const Request& req, Response& res) {
    Caller caller;
    if (!Identify(req, res, true, &caller)) return;
    v1::CordonNodeRequest r;
    if (!ParseBody(req, &r, res)) return;
    r.set_node_id(req.matches[1]);
    v1::CordonNodeResponse out;
    auto ctx = Context(caller);
    Answer(caller, nodes->CordonNode(ctx.get(), r, &out), out, res);
  }

  void Quota(const Request& req, Response& res) {
    Caller caller;
    if (!Identify(req, res, false, &caller)) return;
    v1::GetQuotaRequest r;
    r.set_user(req.get_param_value("user"));
    r.set_all_accounts(req.get_param_value("all_accounts") == "true");
    v1::QuotaReport out;
    auto ctx = Context(caller);
    Answer(caller, jobs->GetQuota(ctx.get(), r, &out), out, res);
  }

  void Accounts(const Request& req, Response& res) {
    Caller caller;
    if (!Identify(req, res, false, &caller)) return;
    v1::ListAccountsResponse out;
    auto ctx = Context(caller);
    Answer(caller, identity->ListAccounts(ctx.get(), v1::ListAccountsRequest(), &out), out, res);
  }

  void WhoAmI(const Request& req, Response& res) {
    Caller caller;
    if (!Identify(req, res, false, &caller)) return;
    v1::WhoAmIResponse out;
    auto ctx = Context(caller);
    Answer(caller, identity->WhoAmI(ctx.get(), v1::WhoAmIRequest(), &out), out, res);
  }

  // --- live streams (server-sent events) ---

  // A new live stream for `caller`, or nullptr with 503 written: at most options.max_streams
  // at once, kStreamsPerCaller of them a user's (their sessions' and their tokens': a user's
  // tokens counted apart could take every stream; a token that does not authenticate counts as
  // itself, and its stream's call is refused).
  std::shared_ptr<LiveStream> OpenStream(const Caller& caller, Response& res) {
    std::string key = caller.session.has_value() ? "user:" + caller.session->user
                                                 : "token:" + Sha256(caller.token);
    if (!caller.session.has_value()) {
      v1::WhoAmIResponse me;
      auto ctx = Context(caller);
      if (identity->WhoAmI(ctx.get(), v1::WhoAmIRequest(), &me).ok() && !me.user().empty()) {
        key = "user:" + me.user();
      }
    }
    {
      absl::MutexLock lock(&streams_mu);
      int& mine = streams_by_caller[key];
      if (open_streams >= options.max_streams || mine >= kStreamsPerCaller) {
        if (mine == 0) streams_by_caller.erase(key);
        Fail(res, grpc::StatusCode::UNAVAILABLE,
             absl::StrCat("too many live streams open (", options.max_streams, " at once, ",
                          kStreamsPerCaller, " of them yours); close a page and try again"));
        return nullptr;
      }
      ++mine;
      ++open_streams;
    }
    return std::make_shared<LiveStream>([this, key] {
      absl::MutexLock lock(&streams_mu);
      --open_streams;
      if (--streams_by_caller[key] <= 0) streams_by_caller.erase(key);
    });
  }

  // What a producer's call ended with, for the page: "refused" unless it ended well or was
  // cancelled (the page left); a token that no longer authenticates ends its sessions.
  void Ended(const Caller& caller, const grpc::Status& s, LiveStream* stream) {
    if (s.ok() || s.error_code() == grpc::StatusCode::CANCELLED) return;
    if (s.error_code() == grpc::StatusCode::UNAUTHENTICATED) sessions.RemoveToken(caller.token);
    stream->queue().Push(
        "refused", Dump({{"code", CodeName(s.error_code())}, {"message", s.error_message()}}));
  }

  // Ends `stream` (Refuse) once its caller may no longer read it: at once when a browser's
  // session ends (sign-out, expiry, or its token found revoked by another request), and, every
  // options.stream_recheck, when `reread` (a call of the caller's that the stream's page made
  // when it opened) is refused as unauthenticated, denied or not found (a revoked or expired
  // token, a disabled user, an admin no longer one). Without it, a stream authorised once went on
  // for as long as the job ran. Other failures (a failover) leave the stream to its calls.
  void Guard(LiveStream* stream, const Caller& caller, std::function<grpc::Status()> reread) {
    stream->Guard([this, stream, caller, reread = std::move(reread)] {
      absl::Time next = absl::Now() + options.stream_recheck;
      while (true) {
        stream->queue().Sleep(absl::Seconds(1));
        if (stream->queue().closed()) return;
        if (caller.session.has_value() && !sessions.Alive(caller.session_id)) {
          // (This session only: others signed in with the token are theirs.)
          stream->Refuse(
              grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                           "your session ended (signed out, or unused too long): sign in again"));
          return;
        }
        if (!reread || absl::Now() < next) continue;
        const grpc::Status s = reread();
        next = absl::Now() + options.stream_recheck;
        const grpc::StatusCode code = s.error_code();
        if (code != grpc::StatusCode::UNAUTHENTICATED &&
            code != grpc::StatusCode::PERMISSION_DENIED && code != grpc::StatusCode::NOT_FOUND) {
          continue;
        }
        // The token no longer authenticates: every session signed in with it ends.
        if (code == grpc::StatusCode::UNAUTHENTICATED) sessions.RemoveToken(caller.token);
        stream->Refuse(s);
        return;
      }
    });
  }

  // Writes `stream`'s events to the browser until it goes, the stream ends or the console stops.
  void Serve(Response& res, std::shared_ptr<LiveStream> stream) {
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, stream](size_t, httplib::DataSink& sink) {
          std::string out;
          absl::Time last_write = absl::Now();
          while (!stopping.load()) {
            const bool open = stream->queue().Take(&out, absl::Milliseconds(500));
            // A comment each idle second: a browser that left is noticed at the next write or
            // the one after (the HTTP library tells nothing sooner), so its stream slot and
            // gRPC calls are given back within about two seconds.
            if (out.empty() && absl::Now() - last_write >= absl::Seconds(1)) out = ":\n\n";
            if (!out.empty()) {
              if (!sink.write(out.data(), out.size())) return false;
              out.clear();
              last_write = absl::Now();
            }
            if (!open) break;
          }
          sink.done();
          return true;
        },
        [stream](bool) { stream->Close(); });
  }

  // GET /api/v1/jobs/ID/events: "job" (the job after each change), "log" (the last 1000 lines,
  // then each new one), "step" (every step kept, then each new one).
  void JobEvents(const Request& req, Response& res) {
    Caller caller;
    if (!Identify(req, res, false, &caller)) return;
    const std::string job_id = req.matches[1];
    {
      // Refused before the stream starts: another user's job is a plain 403/404.
      v1::GetJobRequest r;
      r.set_job_id(job_id);
      v1::Job job;
      auto ctx = Context(caller);
      grpc::Status s = jobs->GetJob(ctx.get(), r, &job);
      if (!s.ok()) return Refusal(caller, s, res);
    }
    std::shared_ptr<LiveStream> stream = OpenStream(caller, res);
    if (stream == nullptr) return;
    // (Producers hold the stream by pointer: it is closed, which joins them, before it goes.)
    LiveStream* live = stream.get();
    auto* stub = jobs.get();
    grpc::ClientContext* watch_ctx = live->NewContext(Metadata(caller));
    live->Run([this, caller, live, stub, watch_ctx, job_id] {
      v1::WatchJobRequest r;
      r.set_job_id(job_id);
      auto reader = stub->WatchJob(watch_ctx, r);
      v1::JobEvent event;
      while (reader->Read(&event)) {
        if (!live->queue().Push("job", ToJson(event.job()))) break;
      }
      Ended(caller, reader->Finish(), live);
    });
    grpc::ClientContext* log_ctx = live->NewContext(Metadata(caller));
    live->Run([this, caller, live, stub, log_ctx, job_id] {
      v1::StreamLogsRequest r;
      r.set_job_id(job_id);
      r.set_follow(true);
      r.set_tail(1000);
      auto reader = stub->StreamLogs(log_ctx, r);
      v1::LogLine line;
      while (reader->Read(&line)) {
        if (!live->queue().Push("log", ToJson(line))) break;
      }
      Ended(caller, reader->Finish(), live);
    });
    grpc::ClientContext* step_ctx = live->NewContext(Metadata(caller));
    live->Run([this, caller, live, stub, step_ctx, job_id] {
      v1::StreamMetricsRequest r;
      r.set_job_id(job_id);
      r.set_follow(true);
      auto reader = stub->StreamMetrics(step_ctx, r);
      v1::StepReport step;
      while (reader->Read(&step)) {
        if (!live->queue().Push("step", ToJson(step))) break;
      }
      Ended(caller, reader->Finish(), live);
    });
    live->Started();
    Guard(live, caller, [this, caller, job_id] {
      v1::GetJobRequest r;
      r.set_job_id(job_id);
      v1::Job job;
      auto ctx = Context(caller, absl::Seconds(5));  // (Close waits for it)
      return jobs->GetJob(ctx.get(), r, &job);
    });
    Serve(res, std::move(stream));
  }

  // GET /api/v1/jobs/events?<the list's filters>: "jobs" (a ListJobsResponse) at once and after
  // every change of the first page; "refused" ({code, message}) and the end when a later read
  // is refused (the token was revoked).
  void ListEvents(const Request& req, Response& res) {
    Caller caller;
    if (!Identify(req, res, false, &caller)) return;
    v1::ListJobsRequest r;
    std::string name, account;
    if (!ListRequest(req, res, &r, &name, &account)) return;
    v1::ListJobsResponse first;
    grpc::Status s = List(caller, r, name, account, &first);
    if (!s.ok()) return Refusal(caller, s, res);
    std::shared_ptr<LiveStream> stream = OpenStream(caller, res);
    if (stream == nullptr) return;
    LiveStream* live = stream.get();
    std::string last = ToJson(first);
    live->queue().Push("jobs", last);
    // A filtered list reads up to kFilterScanJobs jobs a look: it looks five times less often.
    const absl::Duration poll =
        name.empty() && account.empty() ? options.list_poll : options.list_poll * 5;
    live->Run([this, live, caller, r, name, account, last, poll]() mutable {
      while (!live->queue().closed()) {
        live->queue().Sleep(poll);
        if (live->queue().closed()) break;
        v1::ListJobsResponse page;
        grpc::Status s = List(caller, r, name, account, &page, &live->queue());
        if (!s.ok()) {
          Ended(caller, s, live);
          break;
        }
        std::string now = ToJson(page);
        if (now != last) {
          last = std::move(now);
          if (!live->queue().Push("jobs", last)) break;
        }
      }
    });
    live->Started();
    Guard(live, caller, nullptr);  // (its reads are its own rechecks)
    Serve(res, std::move(stream));
  }

  // --- pages ---

  void Routes() {
    httplib::Server& s = *server;
    s.set_default_headers(SecurityHeaders());
    s.set_payload_max_length(kMaxBody);
    s.set_read_timeout(10, 0);
    s.set_write_timeout(10, 0);
    s.set_keep_alive_max_count(100);
    // An idle kept-alive connection holds one of the pool's threads: not for long (the pages'
    // 5-second polls then open a new one).
    s.set_keep_alive_timeout(2);
    // Answers go out as written: a header and its body, or an event, are never held back for
    // the peer's delayed ACK (Nagle's 40 ms).
    s.set_tcp_nodelay(true);  // (the pool of options.threads: NewListener's)
    auto bind = [this](void (Impl::*f)(const Request&, Response&)) {
      return [this, f](const Request& req, Response& res) { (this->*f)(req, res); };
    };
    const std::string id = kIdPattern;
    s.Post("/api/v1/session", bind(&Impl::SignIn));
    s.Post("/api/v1/session/link", bind(&Impl::SignInLink));
    s.Get("/api/v1/session", bind(&Impl::Session));
    s.Delete("/api/v1/session", bind(&Impl::SignOut));
    s.Get("/api/v1/whoami", bind(&Impl::WhoAmI));
    s.Get("/api/v1/jobs", bind(&Impl::ListJobs));
    s.Get("/api/v1/jobs/events", bind(&Impl::ListEvents));
    s.Get("/api/v1/jobs/" + id, bind(&Impl::GetJob));
    s.Get("/api/v1/jobs/" + id + "/logs", bind(&Impl::Logs));
    s.Get("/api/v1/jobs/" + id + "/metrics", bind(&Impl::Metrics));
    s.Get("/api/v1/jobs/" + id + "/events", bind(&Impl::JobEvents));
    s.Post("/api/v1/jobs/" + id + "/cancel", bind(&Impl::Cancel));
    s.Post("/api/v1/jobs/" + id + "/checkpoint", bind(&Impl::Checkpoint));
    s.Get("/api/v1/nodes", bind(&Impl::ListNodes));
    s.Post("/api/v1/nodes/" + id + "/cordon", bind(&Impl::Cordon));
    s.Get("/api/v1/quota", bind(&Impl::Quota));
    s.Get("/api/v1/accounts", bind(&Impl::Accounts));
    s.Get("/favicon.ico", [](const Request&, Response& res) { res.status = 204; });
    for (size_t i = 0; i < kWebAssetCount; ++i) {
      const WebAsset& a = kWebAssets[i];
      const std::string type = absl::StrCat(a.content_type, "; charset=utf-8");
      auto serve = [&a, type](const Request&, Response& res) {
        res.set_content(reinterpret_cast<const char*>(a.data), a.size, type.c_str());
      };
      s.Get(a.path, serve);
      if (std::string(a.path) == "/index.html") s.Get("/", serve);
    }
    s.set_error_handler([](const Request& req, Response& res) {
      if (!res.body.empty()) return;
      if (res.status == 404) {
        Fail(res, grpc::StatusCode::NOT_FOUND, "no such page or API path");
      } else if (res.status == 413) {
        Fail(res, grpc::StatusCode::INVALID_ARGUMENT,
             absl::StrCat("body: larger than ", kMaxBody, " bytes"));
        res.status = 413;  // (Fail set 400)
      } else if (res.status >= 400) {
        res.set_content(Dump({{"error", {{"code", res.status}}}}), kJson);
      }
    });
    s.set_exception_handler([](const Request&, Response& res, std::exception_ptr) {
      Fail(res, grpc::StatusCode::INTERNAL, "internal error");
    });
  }
};

WebConsole::WebConsole(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

namespace {

// A server for options.address, HTTPS with options' certificate when it has one; not yet bound.
struct Listener {
  std::unique_ptr<GuardedHttpServer> server;
  std::string host;  // without brackets
  int port = 0;      // 0: any
};

absl::StatusOr<Listener> NewListener(const WebConsoleOptions& options) {
  Listener l;
  const size_t colon = options.address.rfind(':');
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(options.address.substr(colon + 1), &l.port) || l.port < 0 ||
      l.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--web-address: expected HOST:PORT, got '", options.address, "'"));
  }
  l.host = options.address.substr(0, colon);
  if (l.host.size() > 2 && l.host.front() == '[' && l.host.back() == ']') {
    l.host = l.host.substr(1, l.host.size() - 2);
  }
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls-cert, --tls-key: give both or neither");
  }
  std::shared_ptr<const ps::TlsConfig> tls;
  if (!options.tls_cert_file.empty()) {
    // A renewed certificate serves new connections without a restart, as gRPC's listener's does.
    ASSIGN_OR_RETURN(tls, ps::TlsConfig::Server(options.tls_cert_file, options.tls_key_file,
                                                options.tls_reload));
  }
  ConnectionLimits limits;
  // (httplib's default is 8 threads: one peer's limit is more.)
  limits.threads = options.threads;
  limits.max_queued = 4 * options.threads;
  limits.request_time = options.request_time;
  limits.per_peer = options.max_connections_per_peer;
  limits.per_peer_busy = std::min(options.max_connections_per_peer, 8);
  limits.busy_at = std::max(1, options.threads * 3 / 4);
  for (const std::string& proxy : options.trusted_proxies) {
    if (std::optional<std::string> address = CanonicalAddress(proxy); address.has_value()) {
      limits.exempt.push_back(*std::move(address));
    }
  }
  l.server = std::make_unique<GuardedHttpServer>(std::move(limits), std::move(tls));
  return l;
}

// Binds `server` (l's, or where it went) to l's address and serves on a thread of its own
// (`thread`): the URL, with the bound port (also set in l.port).
absl::StatusOr<std::string> Serve(GuardedHttpServer& server, Listener& l,
                                  const std::string& address, std::thread* thread) {
  int bound = l.port;
  if (l.port == 0) {
    bound = server.bind_to_any_port(l.host);
  } else if (!server.bind_to_port(l.host, l.port)) {
    bound = -1;
  }
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("--web-address: cannot listen on ", address));
  }
  l.port = bound;
  server.WidenBacklog();
  *thread = std::thread([&server] {
    pthread_setname_np(pthread_self(), "ty-web");
    server.listen_after_bind();
  });
  // A stop() before the thread listens would be lost (and its join wait for ever): return once
  // it listens. (Polled: the library tells nothing.)
  for (int i = 0; i < 10000 && !server.is_running(); ++i) absl::SleepFor(absl::Milliseconds(1));
  const std::string shown = l.host.find(':') != std::string::npos ? "[" + l.host + "]" : l.host;
  return absl::StrCat(server.tls() ? "https://" : "http://", shown, ":", bound);
}

}  // namespace

absl::StatusOr<std::unique_ptr<WebConsole>> WebConsole::Start(
    const WebConsoleOptions& options, std::shared_ptr<grpc::Channel> coordinator) {
  ASSIGN_OR_RETURN(std::string public_origin, WebPublicOrigin(options.public_url));
  std::vector<std::string> trusted_proxies;
  for (const std::string& proxy : options.trusted_proxies) {
    std::optional<std::string> address = CanonicalAddress(proxy);
    if (!address.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--web-trusted-proxies: '", absl::CHexEscape(proxy.substr(0, 64)),
          "' is not an IP address (a proxy's address as the console sees it connect, no port)"));
    }
    trusted_proxies.push_back(*std::move(address));
  }
  ASSIGN_OR_RETURN(Listener l, NewListener(options));
  auto impl = std::make_unique<Impl>(options);
  impl->channel = std::move(coordinator);
  impl->jobs = v1::JobService::NewStub(impl->channel);
  impl->nodes = v1::NodeService::NewStub(impl->channel);
  impl->identity = v1::IdentityService::NewStub(impl->channel);
  impl->server = std::move(l.server);
  impl->tls = impl->server->tls();
  impl->public_origin = public_origin;
  impl->trusted_proxies = std::move(trusted_proxies);
  impl->Routes();
  ASSIGN_OR_RETURN(impl->url, Serve(*impl->server, l, options.address, &impl->listener));
  impl->bound_url = impl->url;
  if (!public_origin.empty()) {
    spdlog::info("web console at {}, reached at {}", impl->url, public_origin);
    impl->url = public_origin;
  } else {
    spdlog::info("web console at {}", impl->url);
  }
  return std::unique_ptr<WebConsole>(new WebConsole(std::move(impl)));
}

WebConsole::~WebConsole() {
  impl_->stopping.store(true);
  impl_->server->stop();
  if (impl_->listener.joinable()) impl_->listener.join();
}

const std::string& WebConsole::url() const { return impl_->url; }

struct WebRedirect::Impl {
  Listener listener;
  std::thread thread;
  absl::Mutex mu;
  std::string leader ABSL_GUARDED_BY(mu);
};

WebRedirect::WebRedirect(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<WebRedirect>> WebRedirect::Start(const WebConsoleOptions& options) {
  auto impl = std::make_unique<Impl>();
  ASSIGN_OR_RETURN(impl->listener, NewListener(options));
  GuardedHttpServer& s = *impl->listener.server;
  s.set_default_headers(SecurityHeaders());
  s.set_payload_max_length(kMaxBody);
  s.set_read_timeout(10, 0);
  s.set_tcp_nodelay(true);
  Impl* raw = impl.get();
  const bool behind_proxy = !options.public_url.empty();
  auto answer = [raw, behind_proxy](const Request& req, Response& res) {
    std::string leader;
    {
      absl::MutexLock lock(&raw->mu);
      leader = raw->leader;
    }
    if (leader.empty() || behind_proxy) {
      // (Behind a proxy, browsers are the proxy's to send to the leader: a redirect past it
      // would go to an address they may not reach, in clear. A 503 takes this one out of its
      // rotation.)
      Fail(res, grpc::StatusCode::UNAVAILABLE,
           behind_proxy ? "this coordinator stands by: another replica leads"
                        : "this coordinator stands by and no replica leads now (or the leader "
                          "serves no web console); try again shortly");
      res.set_header("Retry-After", "1");
      return;
    }
    if (req.target.empty() || req.target[0] != '/') {
      Fail(res, grpc::StatusCode::INVALID_ARGUMENT, "the request's target must be a path");
      return;
    }
    // The same path and query at the leader's (307 keeps a POST a POST).
    res.status = 307;
    res.set_header("Location", leader + req.target);
    res.set_content(Dump({{"leader", leader}}), kJson);
  };
  s.Get(".*", answer);
  s.Post(".*", answer);
  s.Delete(".*", answer);
  ASSIGN_OR_RETURN(std::string url, Serve(s, impl->listener, options.address, &impl->thread));
  spdlog::info("standing by: the web console at {} sends browsers to the leader's", url);
  return std::unique_ptr<WebRedirect>(new WebRedirect(std::move(impl)));
}

WebRedirect::~WebRedirect() {
  impl_->listener.server->stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

void WebRedirect::SetLeader(const std::string& url) {
  absl::MutexLock lock(&impl_->mu);
  impl_->leader = url;
}

int WebRedirect::port() const { return impl_->listener.port; }

}  // namespace trainyard::web
