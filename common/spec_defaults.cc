// The job spec's defaults, filled once where a spec comes in (yard, the coordinator, the
// trainer): the table's (spec_schema.cc), then those that follow from other fields.
#include "common/spec.h"
#include "common/spec_schema.h"

namespace trainyard {

using v1::JobSpec;

void ApplyJobSpecDefaults(JobSpec& spec) {
  spec_schema::ApplyDefaults(spec, spec_schema::Scope::kEveryJob);
  // nodes (torchrun's --nnodes) alone: a device on each.
  auto& r = *spec.mutable_resources();
  if (r.nodes() > 0 && r.slots() == 0) r.set_slots(r.nodes());
  if (IsCommandJob(spec)) return;  // the program's own settings are its business
  spec_schema::ApplyDefaults(spec, spec_schema::Scope::kTrainingJob);
  auto& m = *spec.mutable_model();
  if (m.kind() == "mlp" && m.d_hidden() == 0) m.set_d_hidden(4 * m.d_model());
  // llama without a checkpoint: Llama's MLP width (8/3 d_model, rounded up to a multiple of 64)
  // and defaults; with one, its config.json fills what is left at 0 (in the trainer).
  if (m.kind() == "llama" && m.from().empty()) {
    if (m.d_hidden() == 0) m.set_d_hidden((8 * m.d_model() / 3 + 63) / 64 * 64);
    if (m.n_kv_head() == 0) m.set_n_kv_head(m.n_head());
    if (m.rope_theta() == 0) m.set_rope_theta(10000);
    if (m.rms_norm_eps() == 0) m.set_rms_norm_eps(1e-6);
  }
  if (m.vocab() == 0 && spec.data().format() == "bytes") m.set_vocab(256);
  const auto& p = spec.parallel();
  auto& t = *spec.mutable_train();
  if (t.micro_batches() == 0 && p.pipeline_stages() > 1) {
    t.set_micro_batches(2 * p.pipeline_stages());
  }
}

}  // namespace trainyard
