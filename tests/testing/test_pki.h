// A throw-away PKI for TLS tests, made with the openssl command: a CA and, signed by it, a
// certificate for 127.0.0.1 (the servers', server.pem/server.key) and one per name asked for
// (CN = the name), all with EC keys; and a second CA ("other-ca") that signed nothing. Failures
// fail the test (gtest). One test thread uses each object.
#ifndef TRAINYARD_TESTS_TESTING_TEST_PKI_H_
#define TRAINYARD_TESTS_TESTING_TEST_PKI_H_

#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "tests/testing/subprocess.h"

namespace trainyard::testing {

class TestPki {
 public:
  explicit TestPki(const std::string& dir) : dir_(dir) {
    std::ofstream(dir_ + "/ext.cnf") << "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                        "extendedKeyUsage=serverAuth,clientAuth\n";
    MakeCa("ca");
    MakeCa("other-ca");
    Sign("server", "127.0.0.1");
  }

  // A certificate (NAME.pem, NAME.key) whose common name is `name`.
  void Sign(const std::string& file, const std::string& name) {
    Openssl({"req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", Path(file + ".key"), "-out", Path(file + ".csr"), "-subj", "/CN=" + name});
    Openssl({"x509", "-req", "-in", Path(file + ".csr"), "-CA", Path("ca.pem"), "-CAkey",
             Path("ca.key"), "-CAcreateserial", "-out", Path(file + ".pem"), "-days", "2",
             "-extfile", Path("ext.cnf")});
  }

  // As Sign, for the subject alternative names `san` ("IP:10.0.0.9,DNS:other") instead.
  void SignWithSan(const std::string& file, const std::string& name, const std::string& san) {
    SignBy("ca", file, name,
           "subjectAltName=" + san + "\nextendedKeyUsage=serverAuth,clientAuth\n");
  }

  // A certificate (FILE.pem, FILE.key) with common name `name`, signed by the CA `ca` ("ca" or
  // "other-ca"), with `extensions` (openssl's extfile lines).
  void SignBy(const std::string& ca, const std::string& file, const std::string& name,
              const std::string& extensions) {
    std::ofstream(Path(file + ".cnf")) << extensions;
    Openssl({"req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", Path(file + ".key"), "-out", Path(file + ".csr"), "-subj", "/CN=" + name});
    Openssl({"x509", "-req", "-in", Path(file + ".csr"), "-CA", Path(ca + ".pem"), "-CAkey",
             Path(ca + ".key"), "-CAcreateserial", "-out", Path(file + ".pem"), "-days", "2",
             "-extfile", Path(file + ".cnf")});
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

 private:
  void MakeCa(const std::string& name) {
    Openssl({"req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", Path(name + ".key"), "-out", Path(name + ".pem"), "-days", "2", "-subj",
             "/CN=trainyard test " + name});
  }

  static void Openssl(std::vector<std::string> args) {
    args.insert(args.begin(), "/usr/bin/openssl");
    CommandResult r = RunCommand(args, {}, absl::Seconds(60));
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }

  std::string dir_;
};

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_TEST_PKI_H_
