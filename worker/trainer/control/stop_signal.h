// SIGTERM as a request to stop, held by the kernel rather than by a flag of ours: the rank's main
// thread blocks SIGTERM, so a SIGTERM waits there as pending until the training loop takes it
// between steps (TakeStopSignal), and every thread started afterwards (Gloo's, gRPC's, the
// offload pusher's) inherits the block. Threads that LibTorch and its libraries start before
// main runs do not; a handler without state sends a SIGTERM that lands on one of them on to the
// main thread, where it waits too. No mutable global: the pending set is the flag.
#ifndef TRAINYARD_WORKER_TRAINER_CONTROL_STOP_SIGNAL_H_
#define TRAINYARD_WORKER_TRAINER_CONTROL_STOP_SIGNAL_H_

namespace trainyard::trainer {

// Called first thing in main, from the main thread (the one whose thread id is the process id).
void HoldStopSignal();

// True once per SIGTERM (several before a call count once), from the main thread.
bool TakeStopSignal();

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_CONTROL_STOP_SIGNAL_H_
