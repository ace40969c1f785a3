// step_arrays.h — one training step as arrays: the format step_trace.h documents, which the step
// trace records and the step plan (step_plan.h) reads.
#pragma once

#include <cstdint>
#include <vector>

namespace pymem {

struct StepArrays {
  std::vector<int32_t> op;
  std::vector<double> op_cost;
  std::vector<int64_t> op_transient;  // optional (empty: none known); see step_trace.h
  std::vector<int64_t> inputs_start{0};
  std::vector<int32_t> inputs;
  std::vector<int64_t> outputs_start{0};
  std::vector<int32_t> outputs;
  std::vector<int64_t> value_bytes;
  std::vector<int32_t> value_producer;
  std::vector<uint8_t> value_recomputable;
  std::vector<int32_t> value_free_at;  // optional (empty: not known); see step_trace.h
  std::vector<int32_t> value_overwrites;  // optional (empty: not known); see step_trace.h
  std::vector<uint8_t> value_blank_rerun;  // optional (empty: not known); see step_trace.h
  std::vector<int32_t> released_at;
  std::vector<int32_t> released_value;
  std::vector<int32_t> back_at;
  std::vector<int32_t> back_value;
};

}  // namespace pymem
