// The smallest valid job spec, for tests where ranks do not really train (test_rank reads only
// the job's name, which tells it how to behave).
#ifndef TRAINYARD_TESTS_TESTING_TINY_SPEC_H_
#define TRAINYARD_TESTS_TESTING_TINY_SPEC_H_

#include <string>

#include "trainyard/v1/job.pb.h"

namespace trainyard::testing {

inline v1::JobSpec TinySpec(const std::string& name, int devices, int max_restarts = 0) {
  v1::JobSpec s;
  s.set_name(name);
  s.mutable_resources()->set_slots(devices);
  auto* m = s.mutable_model();
  m->set_n_layer(1);
  m->set_n_head(1);
  m->set_d_model(8);
  m->set_seq_len(4);
  s.mutable_data()->set_path("/usr/share/common-licenses/GPL-3");
  s.mutable_train()->set_steps(10);
  s.set_max_restarts(max_restarts);
  return s;
}

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_TINY_SPEC_H_
