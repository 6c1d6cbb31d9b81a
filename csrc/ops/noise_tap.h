// The noise scale's tap on the CPU (mbs_ext/model/grads.py, TakenGrads): each parameter's gradient
// of a micro-batch goes into its sum, with its squares, as the backward hands it to autograd's
// accumulation, while it is still in the caches.
//
// A hook before each parameter's AccumulateGrad node (a node pre-hook: it leaves the parameter's
// own tensor hooks, Python's or C++'s, as they are) sees the gradient autograd is about to
// accumulate. The first micro-batch's backward runs without them: autograd takes each gradient as
// the .grad (the sum), and the hooks go on when the second micro-batch is weighed. A parameter's
// first gradient of the step (the first micro-batch's, or a later one's) goes on to autograd in
// the same way. A later one is added into the sum by the op's CPU loop with its squares
// (add_squares_cpu, at scale 1: the micro-batch's weight rode its loss), and autograd is handed
// nothing to add: one pass over the sum, as autograd's own `.grad += g` would make, with the
// squares in it, the sum the same tensor throughout. A parameter with a post-accumulate-grad
// hook is handed its sum instead, with .grad emptied, so that autograd takes it back and runs the
// hook as it would. The first gradient's own squares come with the sum's next addition or from
// read_pending(). The sums of squares are host numbers, one per micro-batch: no tensor per
// micro-batch, no Python per parameter.
//
// A streamer's steps reuse one tap (making one costs a step tens of microseconds on the CPU), its
// hooks on only within a step: from the second micro-batch's weigh() to end().
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <utility>
#include <vector>

namespace mbs {

struct TapState;
struct TapHooks;

class NoiseTap {
 public:
  // params: the parameters (dense CPU float leaves that require grad); found_inf: the 0-dim
  // float32 flag every kernel call here sets on inf/NaN. No hook until a step's second micro-batch.
  NoiseTap(std::vector<at::Tensor> params, at::Tensor found_inf);
  ~NoiseTap();
  NoiseTap(const NoiseTap&) = delete;
  NoiseTap& operator=(const NoiseTap&) = delete;

  // A step begins, every parameter's .grad empty: no squares, found_inf cleared.
  void begin();
  // The step is over (or failed): the hooks come off (autograd alone accumulates until the next
  // step's second micro-batch).
  void end();
  // `loss * weight` (weight a host number, or a 0-dim tensor cast to the loss's dtype), as the
  // step weighs a micro-batch's loss before its backward, and that micro-batch begun: its squares
  // add up apart from the last one's. One call where the step makes one anyway (the product).
  at::Tensor weigh(const at::Tensor& loss, double weight);
  at::Tensor weigh(const at::Tensor& loss, const at::Tensor& weight);
  // Each micro-batch's sum of squares of its gradient (float64), the running one's last.
  const std::vector<double>& squares() const;
  // The squares of the sums that are still one gradient as autograd took it, into those of
  // the micro-batch it came from (before the sums are rescaled or read).
  void read_pending();
  // The step's end, once its sums are final: the sums' squared norm (the step's |G_B|^2), end(), and
  // whether a parameter's gradient came in parts within one micro-batch after the first
  // (reentrant checkpointing, a second backward) or under grad mode: autograd then accumulated it
  // without the tap, and the squares taken are not the micro-batches' own. (The first
  // micro-batch's parts add up in its sum before its squares are read: exact.) One call.
  std::pair<double, bool> finish();
  // Remove the hooks and let go of the accumulation nodes (when the tap is dropped); the
  // destructor does it too.
  void detach();

 private:
  // read_pending(), then the squared norm of the sums (every parameter's .grad) in one read, their
  // non-finite check setting found_inf: the step's |G_B|^2, once the sums are final.
  double sum_squares();
  // A micro-batch begins: the first has its slot from begin(); the second takes the first's sums
  // and puts the hooks on.
  void start_micro_batch();

  std::shared_ptr<TapState> state_;
  std::unique_ptr<TapHooks> hooks_;
};

}  // namespace mbs
