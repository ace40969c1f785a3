// history.h — the arena's opt-in event log, for memory_viz snapshots.
//
// A bounded ring of allocation events, appended under the arena's lock. Off by default: the arena
// then holds no History and pays one null check per allocate and free. Labels say why an event
// happened when the layer above knows it (an eviction, a rematerialization, a compaction move);
// plain allocations and frees carry none.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

namespace pymem {

struct HistoryEvent {
  enum class Action { Alloc, Free };
  Action action;
  uintptr_t addr;
  size_t size;
  int64_t time_us;  // wall clock, microseconds since the epoch (Python's time.time() * 1e6)
  std::string label;
};

class History {
 public:
  explicit History(size_t max_entries);
  // An allocation or free by the arena itself; a free picks up a label left by label_next_free.
  void record(HistoryEvent::Action action, uintptr_t addr, size_t size);
  // The next free of `addr` happens because of `label` (the caller is about to free it).
  void label_next_free(uintptr_t addr, std::string label);
  // The newest allocation of `addr` happened because of `label` (the caller just learned why).
  void label_last_alloc(uintptr_t addr, const std::string& label);
  // An event the arena does not see as an allocation or a free: a compaction move's two halves.
  void note(HistoryEvent::Action action, uintptr_t addr, size_t size, std::string label);
  std::vector<HistoryEvent> events() const;  // oldest first

 private:
  void push(HistoryEvent e);

  size_t max_entries_;
  std::deque<HistoryEvent> ring_;
  std::unordered_map<uintptr_t, std::string> pending_free_labels_;
};

}  // namespace pymem
