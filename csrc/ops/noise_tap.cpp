// The noise scale's tap: hooks before autograd's accumulation (ops/noise_tap.h says why).
#include "ops/noise_tap.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <c10/core/GradMode.h>

#include <algorithm>
#include <unordered_set>
#include <utility>

#include "ops/kernels.h"

namespace mbs {

namespace ag = torch::autograd;

constexpr int64_t kNone = -1;

struct TapState {
  std::vector<at::Tensor> params;
  // Per parameter: the micro-batch whose gradient its sum still is, as autograd took it (its
  // squares not yet summed), or kNone.
  std::vector<int64_t> pending;
  // Per parameter: the micro-batch of the last gradient it was handed, or kNone.
  std::vector<int64_t> last;
  // A parameter's gradient came in parts within one micro-batch (reentrant checkpointing, a
  // second backward) or under grad mode: the squares taken are not the micro-batches' own.
  bool split = false;
  bool in_step = false;  // between begin() and end()
  int64_t begun = 0;  // micro-batches weighed since begin()
  bool first_taken = false;  // take_first() ran this step
  std::vector<double> squares;  // per micro-batch; the last is the running one's
  at::Tensor found_inf;
  // 0-dim float64s the kernels add their sums of squares to, read into `squares` after each call.
  at::Tensor scratch = at::zeros({}, at::kDouble);
  at::Tensor scratch_sum = at::zeros({}, at::kDouble);

  // The sum of the squares of `tensors` (dense), their non-finite check setting found_inf.
  double squares_of(at::TensorList tensors);
  // The squares of `tensor` into micro-batch `index`'s.
  void read(const at::Tensor& tensor, int64_t index);
  // After the first micro-batch's backward (which runs without the hooks: autograd takes each
  // gradient as the sum, or adds its parts): each sum is that micro-batch's gradient, its squares
  // to be read; a sparse sum made dense (the sums are dense).
  void take_first();
};

namespace {

// What autograd's accumulation node of a leaf is held by (a shared or an intrusive pointer,
// by torch version).
using AccumulatorPtr = decltype(ag::impl::grad_accumulator(std::declval<const ag::Variable&>()));

void bump_version(const at::Tensor& t) {
  if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

at::Tensor dense(const at::Tensor& t) { return t.is_non_overlapping_and_dense() ? t : t.contiguous(); }

// Zeroed for a kernel to add to; what it added.
double& zeroed(const at::Tensor& scratch) {
  double& value = *scratch.data_ptr<double>();
  value = 0.0;
  return value;
}

// Whether `g` adds into `sum` in place through the kernels: one dtype and layout, dense, apart.
bool fusable(const at::Tensor& sum, const at::Tensor& g) {
  return sum.scalar_type() == g.scalar_type() && sum.sizes() == g.sizes() && sum.strides() == g.strides() &&
         sum.is_non_overlapping_and_dense() && !sum.is_alias_of(g);
}

class TapHook final : public ag::FunctionPreHook {
 public:
  // The state is held, not locked per call (a hook runs for every parameter of every micro-batch):
  // a hook lives on its node until end() (or the node's end), and the state as long as a hook.
  TapHook(std::shared_ptr<TapState> state, size_t index) : state_(std::move(state)), index_(index) {}

  ag::variable_list operator()(const ag::variable_list& grads) override {
    TapState* const state = state_.get();
    if (grads.size() != 1 || !grads[0].defined()) return grads;
    const auto current = static_cast<int64_t>(state->squares.size()) - 1;
    // Squares of the parts are not the square of their sum (and an in-place add under grad mode
    // would escape the graph): autograd accumulates as it would without the tap, and the step
    // says it could not measure (TakenGrads).
    if (state->last[index_] == current || c10::GradMode::is_enabled()) {
      state->split = true;
      return grads;
    }
    state->last[index_] = current;
    // A sparse gradient (nn.Embedding(sparse=True)) goes on as a dense one: the sums are dense.
    ag::variable_list out{grads[0].is_sparse() ? grads[0].to_dense() : grads[0]};
    const at::Tensor& g = out[0];
    at::Tensor& sum = state->params[index_].mutable_grad();
    // Its first gradient of the step (a parameter the first micro-batch did not reach): autograd
    // takes it as the sum.
    if (!sum.defined()) {
      state->pending[index_] = current;
      return out;
    }
    const int64_t first = std::exchange(state->pending[index_], kNone);
    if (!fusable(sum, g)) {  // autograd adds it, as it would without the noise scale; squares read apart
      if (first != kNone) state->read(sum, first);
      state->read(g, current);
      return out;
    }
    // One kernel for every addition (called here directly: the op's entry would also lay out pairs
    // and a scale). Where the sum is still a first gradient as taken, its own squares come with the
    // addition (no pass of their own); only there: they cost a pass over a sum out of the caches.
    const at::Tensor& flag = state->found_inf;
    double& squares = zeroed(state->scratch);
    double& sum_squares = zeroed(state->scratch_sum);
    add_squares_cpu({sum}, {g}, state->scratch, first != kNone ? &state->scratch_sum : nullptr, flag);
    state->squares.back() += squares;
    if (first != kNone) state->squares[static_cast<size_t>(first)] += sum_squares;
    bump_version(sum);
    bump_version(flag);
    // Nothing for autograd to add (an undefined gradient: it returns before touching .grad)...
    if (!ag::impl::post_acc_grad_hooks(state->params[index_])) {
      out[0] = at::Tensor();
      return out;
    }
    // ... except where a post-accumulate-grad hook waits: the sum goes on in the gradient's place
    // with .grad emptied, and autograd takes it back as it is, then runs the hook.
    out[0] = std::exchange(sum, at::Tensor());
    return out;
  }

 private:
  std::shared_ptr<TapState> state_;
  size_t index_;
};

}  // namespace

void TapState::take_first() {
  if (std::exchange(first_taken, true)) return;
  for (size_t j = 0; j < params.size(); ++j) {
    at::Tensor& sum = params[j].mutable_grad();
    if (!sum.defined()) continue;
    if (sum.is_sparse()) sum = sum.to_dense();
    pending[j] = last[j] = 0;
  }
}

double TapState::squares_of(at::TensorList tensors) {
  double& value = zeroed(scratch);
  sum_squares_cpu(tensors, scratch, found_inf);
  bump_version(found_inf);
  return value;
}

void TapState::read(const at::Tensor& tensor, int64_t index) {
  squares[static_cast<size_t>(index)] += squares_of({dense(tensor)});
}

struct TapHooks {
  std::vector<AccumulatorPtr> accumulators;  // held: a forward reuses them, hooks and all
  std::vector<const ag::FunctionPreHook*> hooks;  // attached now (none between steps)

  void attach(const std::shared_ptr<TapState>& state) {
    if (!hooks.empty()) return;  // on already
    for (size_t j = 0; j < accumulators.size(); ++j) {
      auto hook = std::make_unique<TapHook>(state, j);
      hooks.push_back(hook.get());
      accumulators[j]->add_pre_hook(std::move(hook));
    }
  }

  void remove() {
    for (size_t j = 0; j < hooks.size(); ++j) {
      auto& pre_hooks = accumulators[j]->pre_hooks();
      const ag::FunctionPreHook* ours = hooks[j];
      pre_hooks.erase(std::remove_if(pre_hooks.begin(), pre_hooks.end(),
                                     [ours](const std::unique_ptr<ag::FunctionPreHook>& h) { return h.get() == ours; }),
                      pre_hooks.end());
    }
    hooks.clear();
  }
};

NoiseTap::NoiseTap(std::vector<at::Tensor> params, at::Tensor found_inf)
    : state_(std::make_shared<TapState>()), hooks_(std::make_unique<TapHooks>()) {
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const at::Tensor& p : params) {
    TORCH_CHECK(seen.insert(p.unsafeGetTensorImpl()).second,
                "NoiseTap: a parameter is listed twice (its gradient would count twice)");
  }
  state_->pending.assign(params.size(), kNone);
  state_->last.assign(params.size(), kNone);
  state_->squares.assign(1, 0.0);
  state_->params = std::move(params);
  state_->found_inf = std::move(found_inf);
  for (size_t j = 0; j < state_->params.size(); ++j) {
    const at::Tensor& p = state_->params[j];
    TORCH_CHECK(p.is_leaf() && p.requires_grad(), "NoiseTap: parameter ", j, " is not a leaf that requires grad");
    hooks_->accumulators.push_back(ag::impl::grad_accumulator(p));
  }
}

NoiseTap::~NoiseTap() { detach(); }

void NoiseTap::begin() {
  TapState& state = *state_;
  TORCH_CHECK(hooks_->accumulators.size() == state.params.size(), "NoiseTap: begin() after detach()");
  hooks_->remove();  // hooks a step left on (one whose release never ran)
  for (size_t j = 0; j < state.params.size(); ++j) {
    TORCH_CHECK(!state.params[j].grad().defined(), "NoiseTap: parameter ", j, " has a .grad at the step's start");
    // A parameter's accumulation node is new where its data was set anew (model.double(), a move
    // and back): the hooks go on the node autograd accumulates through now.
    AccumulatorPtr now = ag::impl::grad_accumulator(state.params[j]);
    if (now != hooks_->accumulators[j]) hooks_->accumulators[j] = std::move(now);
  }
  std::fill(state.pending.begin(), state.pending.end(), kNone);
  std::fill(state.last.begin(), state.last.end(), kNone);
  state.squares.assign(1, 0.0);
  state.begun = 0;
  state.first_taken = false;
  state.split = false;
  *state.found_inf.data_ptr<float>() = 0.0f;
  bump_version(state.found_inf);
  state.in_step = true;
}

void NoiseTap::end() {
  hooks_->remove();
  state_->in_step = false;
}

void NoiseTap::start_micro_batch() {
  TapState& state = *state_;
  TORCH_CHECK(state.in_step, "NoiseTap: weigh() outside begin() ... end()");
  if (state.begun++ == 0) return;  // the first has its slot from begin(), and no hooks
  state.squares.push_back(0.0);
  if (state.begun == 2) {
    state.take_first();
    hooks_->attach(state_);
  }
}

at::Tensor NoiseTap::weigh(const at::Tensor& loss, double weight) {
  start_micro_batch();
  return loss * weight;
}

at::Tensor NoiseTap::weigh(const at::Tensor& loss, const at::Tensor& weight) {
  start_micro_batch();
  return loss * weight.to(loss.scalar_type());
}

const std::vector<double>& NoiseTap::squares() const { return state_->squares; }

void NoiseTap::read_pending() {
  TORCH_CHECK(state_->in_step, "NoiseTap: read_pending() or finish() outside begin() ... end()");
  state_->take_first();  // a step of one micro-batch: its sums are its gradient
  for (size_t j = 0; j < state_->params.size(); ++j) {
    const int64_t first = std::exchange(state_->pending[j], kNone);
    const at::Tensor& sum = state_->params[j].grad();
    if (first != kNone && sum.defined()) state_->read(sum, first);
  }
}

double NoiseTap::sum_squares() {
  read_pending();
  std::vector<at::Tensor> sums;
  for (const at::Tensor& p : state_->params) {
    if (p.grad().defined()) sums.push_back(dense(p.grad()));
  }
  return state_->squares_of(sums);
}

std::pair<double, bool> NoiseTap::finish() {
  const double squares = sum_squares();
  end();
  return {squares, state_->split};
}

void NoiseTap::detach() {
  hooks_->remove();
  hooks_->accumulators.clear();
}

}  // namespace mbs
