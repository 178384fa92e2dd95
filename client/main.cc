// yard: the trainyard command line. Parses the verb and its flags, calls the coordinator through
// YardClient, prints tables for people or JSON (-o json) for scripts. Exit code 0 on success,
// non-zero with a one-line reason on stderr.

#include <grpc/support/log.h>

#include <cstdlib>
#include <string>

#include <CLI/CLI.hpp>

#include "absl/strings/str_cat.h"
#include "client/local_cluster.h"
#include "client/verbs.h"
#include "common/cli_checks.h"
#include "common/credentials.h"
#include "common/version.h"

int main(int argc, char** argv) {
  using namespace trainyard::client;
  // gRPC's own log lines (a failed TLS handshake, ...) would break yard's one-line errors, which
  // say the same in its words; GRPC_VERBOSITY brings them back for debugging.
  if (std::getenv("GRPC_VERBOSITY") == nullptr) gpr_set_log_function([](gpr_log_func_args*) {});
  Cli c;
  Globals& g = c.g;
  g.coordinator = DefaultCoordinator();

  CLI::App app{"yard: submit and watch training jobs on a trainyard cluster"};
  app.set_version_flag("--version", std::string("yard ") + trainyard::kVersion);
  app.require_subcommand(1);
  app.fallthrough();
  app.add_option("--coordinator", g.coordinator,
                 "coordinator HOST:PORT, or several replicas' HOST:PORT,HOST:PORT (env "
                 "TRAINYARD_COORDINATOR)")
      ->capture_default_str();
  app.add_option("-o,--output", g.output, "output format")
      ->check(CLI::IsMember({"table", "json"}))
      ->capture_default_str();
  app.add_option("--token-file", g.token_file,
                 "file holding your API token (mode 0600; env TRAINYARD_TOKEN_FILE); else env "
                 "TRAINYARD_TOKEN, else " +
                     DefaultTokenFile())
      ->envname("TRAINYARD_TOKEN_FILE");
  app.add_option("--tls-ca", g.tls.ca_file,
                 "CA (PEM) to verify a coordinator that serves TLS with (env TRAINYARD_TLS_CA)")
      ->envname(trainyard::kTlsCaEnv);
  app.add_flag("--insecure", g.tls.plaintext_token_ok,
               "send your API token without TLS to a coordinator that is not on this host (only "
               "on a network you trust; env TRAINYARD_INSECURE=1)")
      ->envname("TRAINYARD_INSECURE");

  // `yard submit [FLAGS] -- PROGRAM ARGS...`: what follows the first "--" after the verb is the
  // program, never yard's flags.
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) != "submit") continue;
    for (int j = i + 1; j < argc; ++j) {
      if (std::string(argv[j]) != "--") continue;
      c.args.submit.command.assign(argv + j + 1, argv + argc);
      argc = j;
      break;
    }
    break;
  }
  AddJobVerbs(app, c);
  AddIdentityVerbs(app, c);
  AddAdminVerbs(app, c);
  AddLocalVerbs(app, c);
  AddWebVerb(app, c);
  trainyard::DecimalIntegers(app);
  CLI11_PARSE(app, argc, argv);
  return c.rc;
}
