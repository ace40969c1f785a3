// history.cpp — the arena's opt-in event log (see history.h).
#include "history.h"

#include <chrono>

#include "types.h"

namespace pymem {

namespace {

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// label_last_alloc looks this far back: the allocation it labels happened a few events ago at most
// (the recompute that made it), and a full scan of a large ring per rematerialization would cost.
constexpr size_t kLabelLookback = 256;

}  // namespace

History::History(size_t max_entries) : max_entries_(max_entries) {
  if (max_entries == 0) throw InvalidArgument("history needs room for at least one event (max_entries > 0)");
}

void History::push(HistoryEvent e) {
  ring_.push_back(std::move(e));
  while (ring_.size() > max_entries_) ring_.pop_front();
}

void History::record(HistoryEvent::Action action, uintptr_t addr, size_t size) {
  std::string label;
  if (action == HistoryEvent::Action::Free && !pending_free_labels_.empty()) {
    auto it = pending_free_labels_.find(addr);
    if (it != pending_free_labels_.end()) {
      label = std::move(it->second);
      pending_free_labels_.erase(it);
    }
  }
  push({action, addr, size, now_us(), std::move(label)});
}

void History::label_next_free(uintptr_t addr, std::string label) {
  pending_free_labels_[addr] = std::move(label);
}

void History::label_last_alloc(uintptr_t addr, const std::string& label) {
  size_t seen = 0;
  for (auto it = ring_.rbegin(); it != ring_.rend() && seen < kLabelLookback; ++it, ++seen) {
    if (it->action == HistoryEvent::Action::Alloc && it->addr == addr) {
      it->label = label;
      return;
    }
  }
}

void History::note(HistoryEvent::Action action, uintptr_t addr, size_t size, std::string label) {
  push({action, addr, size, now_us(), std::move(label)});
}

std::vector<HistoryEvent> History::events() const { return {ring_.begin(), ring_.end()}; }

}  // namespace pymem
