// step_trace.h — the trace of one training step: every op execution and every value, as arrays
// (issue 13's step trace, recorded where ops are booked: the fast path and Runtime.run_op).
//
// A step is the ops between two step marks (the end of an optimizer's step(), or pymem.step()).
// Values are storages' contents as the runtime's records hold them (a view is its storage's value):
// a value is made by the op that produced it, or first seen as an input of an op of this step (made
// before the step: a parameter, the batch, the optimizer's state). Values are numbered in the order
// they appear, ops in the order they run; both numberings repeat from step to step when the program
// repeats, so a value is identified across steps by its index (equivalently, by its producer's
// position and its place among that op's outputs). The format, in arrays:
//
//   ops (n):     op[k]           the op's code (op_name(code) gives its name, "aten.mm.default"; codes are per process)
//                op_cost[k]      its cost in seconds (measured, or the cost model's)
//                op_transient[k] bytes its kernel held at its peak beyond its inputs and outputs
//                                (workspace, temporaries: Arena::transient_since); optional
//                                (empty: none known, as on the meta device). The plan counts
//                                them at the op (plan_cover.h): a convolution's backward takes
//                                up to 32 MiB of them on the CPU.
//                inputs_start[k] .. inputs_start[k+1]    its inputs: indices into `inputs` (value
//                                indices, in argument order, unmanaged tensors left out)
//                outputs_start[k] .. outputs_start[k+1]  its outputs that are fresh values: indices
//                                into `outputs` (value indices; a view of an input is no output)
//   values (m):  value_bytes[v]  bytes of its storage
//                value_producer[v]  the op that made it, or -1: made before this step
//                value_recomputable[v]  1 if it got a recipe (it can be evicted and recomputed);
//                                0: a leaf (gradients, optimizer writes, the step's inputs)
//                value_free_at[v]  the op after which its storage died (-1: alive at the step's end);
//                                optional: empty where deaths were not observed. A value can die
//                                after its last use (autograd frees a backward temporary when its
//                                node ends): without it, the plan takes its last use for its death.
//                                The runtime records it for a step that followed its plan whole.
//                value_overwrites[v]  the value whose storage v's producer wrote in place to make v
//                                (-1: a fresh storage); optional, as value_free_at. A rerun of that
//                                op does not reuse the value's storage (a blank buffer, or a copy).
//                value_blank_rerun[v]  1 where v's producer wrote over all of value_overwrites[v]
//                                without reading it (fill_, bernoulli_, copy_ over a whole
//                                storage): its rerun starts from a blank buffer and needs not that
//                                value (dropout's mask needs no activation back); 0 where it reads
//                                it (div_, add_: the rerun copies it first) or overwrote nothing.
//                                Optional, as value_overwrites (empty: every rerun reads it).
// A value's uses are the ops whose inputs list it (forward and backward alike).
//   releases:    released_at[i], released_value[i]   while planning: value released_value[i] left
//                memory (evicted or offloaded) while op released_at[i] ran (or after it, when the
//                plan released it there); what the next step's plan releases early (step_plan.h)
//                back_at[i], back_value[i]   value back_value[i] came back (recomputed or copied)
//                while op back_at[i] ran
//
// A step of more than kMaxStepOps ops is dropped (recording starts over), so memory stays bounded
// where no step is ever marked.
//
// Invariants: touched under the runtime's lock (and the GIL). A record knows its value in the step
// being recorded by (trace_step, trace_value): a record whose trace_step is not the current step
// is a value made before it, and gets an index when first seen.
#pragma once

#include "plan_choice.h"
#include "step_arrays.h"
#include "step_plan.h"
#include "storage.h"

#include <c10/util/ArrayRef.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace pymem {

struct RecordObject;  // record.h

class StepTrace {
 public:
  // One op execution: its inputs' records (null: an unmanaged tensor, left out) and the records it
  // made (fresh outputs, and written values that became new records).
  // True when the plan has work due after this op: take_due() gives the records it releases,
  // take_ahead() those to copy out ahead.
  // `transient`: the kernel's temporaries (op_transient).
  bool record_op(int32_t code, double cost, int64_t transient, c10::ArrayRef<RecordObject*> inputs,
                 c10::ArrayRef<RecordObject*> made);
  // The current step is complete: it becomes the last step, and a new one starts (planned from it
  // when planning). `moved_seconds`: what its compactions' moves cost (the runtime prices them).
  void end_step(double moved_seconds = 0);

  // Planning (step_plan.h): each step is planned from the one before, and followed until it diverges.
  bool planning() const { return planning_; }
  void set_planning(bool on);
  bool following() const { return following_; }       // the step so far is the plan's
  // Following a plan whose next uses guide releases (all ways but kGreedy): what the next three read.
  bool guided() const { return following_ && plan_.releases() != StepPlan::Releases::kGreedy; }
  // Following a cover's plan (either): its early releases priced their evicted readers' recomputes.
  bool covering() const { return following_ && StepPlan::covers(plan_.releases()); }
  int64_t num_divergences() const { return num_divergences_; }  // steps that left their plan
  int64_t num_cover_steps() const { return num_cover_steps_; }  // steps that followed a cover plan whole
  int64_t num_retained() const { return num_retained_; }  // values held past the program's free (step_plan.h)
  // The largest value a plan holds past the program's free of it (0: none held).
  int64_t retain_limit() const { return retain_limit_; }
  void set_retain_limit(int64_t bytes) { retain_limit_ = bytes; }
  // Planned seconds until r's value is next read in this step (+infinity: not again in this step);
  // negative when the plan cannot say (not following, or r's value not seen in this step).
  double seconds_to_next_use(const RecordObject* r) const;
  // The position in the step of that next read (the plan's length: none); negative when unknown.
  // Fixed while r's value is away (nothing reads it then), so it orders copies back (swap.py).
  int64_t next_use_at(const RecordObject* r) const;
  // Planned seconds of the ops before `position` (the current one when negative), to place copies
  // back on the plan's clock; negative when not following a plan.
  double planned_seconds_before(int64_t position) const;
  // The bytes the step's values may occupy (the arena's budget), for plans that cover it; 0: none.
  int64_t budget() const { return budget_; }
  void set_budget(int64_t bytes);
  // How the plan being followed releases early (step_plan.h); meaningful while following().
  StepPlan::Releases plan_releases() const { return plan_.releases(); }
  int64_t planned_ops() const { return static_cast<int64_t>(plan_.size()); }  // the plan's step length
  // While planning: r's value leaves memory now (the plan of the next step releases it early).
  void note_release(const RecordObject* r) { note(r, current_.released_at, current_.released_value); }
  void note_back(const RecordObject* r) { note(r, current_.back_at, current_.back_value); }  // and back now
  // Lets every value held past the program's free go now (the runtime stops mid-step).
  void let_go() { held_.clear(); }
  // The live records of the values the plan releases after the op just booked.
  pybind11::list take_due();
  // Offloading: r's value goes to host memory now. While the steps follow their plan, the value
  // given r's index in a step (made by an op, or first seen) has its copy out started ahead, as
  // soon as it has it, in that step and the next (swap.copy_ahead): r's index is that of the step
  // now or, when r was not seen in it yet, of the step before (a value made there, released here).
  void note_offload(const RecordObject* r);
  // The records given an index by the op just booked whose values were offloaded (note_offload),
  // each as (record, the step position it was last offloaded at: copies out go in that order).
  pybind11::list take_ahead();

  // A step longer than this is dropped and recording starts over: a program that never marks a
  // step (an inference loop) keeps at most this many ops (about 60 MB).
  static constexpr size_t kMaxStepOps = size_t{1} << 20;

  int64_t num_steps() const { return num_steps_; }  // steps completed
  int64_t num_dropped() const { return num_dropped_; }  // steps dropped for their length
  const StepArrays& last() const { return last_; }

 private:
  // The current step's number, from 1 (a record's trace_step starts at 0: seen in no step).
  int64_t step() const { return num_steps_ + num_dropped_ + 1; }
  int32_t value_of(RecordObject* r);  // r's index in the current step, given on first sight
  // A new value for r (made by op `producer`, or -1: before the step); a weakref to r is kept when
  // the plan releases that value early.
  int32_t new_value(RecordObject* r, int32_t producer);
  void note(const RecordObject* r, std::vector<int32_t>& at, std::vector<int32_t>& value);
  // end_step's choice of how to plan the next step (the step that ended moved blocks for
  // `moved_seconds`), and its plan.
  void plan_next(double moved_seconds);
  StepArrays current_, last_;
  StepPlan plan_;
  PlanChoice choice_;  // learned, cover, rebuild, belady or greedy, by what the steps that followed each cost
  int64_t budget_ = 0;
  // The covers of the program as it runs now (kCover's, kRebuild's): each computed once, kept
  // until it changes (or the budget).
  std::vector<std::pair<int32_t, int32_t>> cover_[2];
  bool cover_fresh_[2] = {false, false};
  bool planned_step_ = false;  // the current step started with a plan to follow
  StepArrays learned_from_;   // releases and comebacks of the last step no cover planned
  bool planning_ = false;
  bool following_ = false;
  int64_t num_divergences_ = 0;
  int64_t num_cover_steps_ = 0;
  std::unordered_map<int32_t, pybind11::object> watched_;  // value -> weakref to its record, this step
  std::vector<int32_t> due_;  // values due for release after the op just booked
  // Deaths (value_free_at), observed while a step follows its plan from its start: a value is
  // watched from its last use in the plan (its producer, if none) until its storage dies, so each
  // op checks the few values past their last use that are still held, not every live one.
  void watch_deaths(int32_t k);                 // after op k was booked (and matched the plan)
  // The plan's holds (step_plan.h) after op k: those let go then go, those due are taken (a value in
  // memory, about to be freed by the program). A held value's storage has one holder more than the
  // program's, which watch_deaths discounts: the deaths recorded stay the program's.
  void hold(int32_t k);
  // The input of this step whose storage `made` took over (an in-place op's), or null.
  const RecordObject* overwritten(const RecordObject* made, c10::ArrayRef<RecordObject*> inputs) const;
  // This step's values' storages, by value (while watching): weak, as records would hold what their
  // recipes read. Empty once its death (or an in-place write over it) was noted.
  std::vector<std::optional<StorageRef>> value_storage_;
  std::vector<int32_t> free_at_;                // by value: the op after which it died; -1: alive
  std::vector<int32_t> dying_;                  // values past their last use, still held
  bool deaths_whole_ = false;                   // watched since the step's start, plan followed
  std::unordered_map<int32_t, at::Tensor> held_;  // value -> the strong tensor holding its storage
  int64_t retain_limit_ = 0;
  int64_t num_retained_ = 0;
  // By value index: bit 0, offloaded in this step (note_offload); bit 1, in the step before.
  std::vector<uint8_t> offloaded_;
  std::vector<int32_t> offloaded_at_;  // by value index: the step position of its last note_offload
  std::vector<std::pair<pybind11::object, int32_t>> ahead_;  // (record, offloaded_at_) to copy out ahead
  int64_t num_steps_ = 0;
  int64_t num_dropped_ = 0;
};

// Process-wide op codes: the same op has the same code in every runtime.
int32_t op_code(const std::string& name);
const std::string& op_name(int32_t code);

// _C.StepTrace (a Python object owning one StepTrace); null if `o` is none.
StepTrace* as_step_trace(pybind11::handle o);

}  // namespace pymem
