// bindings_arena.cpp — pymem._C.Arena and friends. pybind11 only, no torch: the same file builds
// the torch-free ASan module the property tests run against.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>

#include "arena.h"
#include "backing.h"
#include "cuda_table.h"
#include "bench.h"
#include "move_plan.h"
#include "py_errors.h"

namespace py = pybind11;

namespace pymem {

namespace {

// Set once by pymem/__init__.py. A leaked handle: a static py::object would decref at exit, after
// the interpreter is finalised.
PyObject* g_out_of_budget = nullptr;

SearchMode parse_mode(const std::string& s) {
  if (s == "window") return SearchMode::Window;
  if (s == "one_at_a_time") return SearchMode::OneAtATime;
  if (s == "handler") return SearchMode::Handler;
  throw InvalidArgument("search must be 'window', 'one_at_a_time' or 'handler', got '" + s + "'");
}

const char* mode_name(SearchMode m) {
  return m == SearchMode::Window ? "window" : m == SearchMode::OneAtATime ? "one_at_a_time" : "handler";
}

CostClass parse_cost_class(const std::string& s) {
  if (s == "costly") return CostClass::Costly;
  if (s == "cheap") return CostClass::Cheap;
  throw InvalidArgument("cost_class must be 'costly' or 'cheap', got '" + s + "'");
}

size_t check_size(long long n, const char* what) {
  if (n <= 0)
    throw InvalidArgument(std::string(what) + " must be a positive number of bytes, got " +
                          std::to_string(n));
  return static_cast<size_t>(n);
}

// A Python callable shared by copies of a std::function. Copies touch only the shared_ptr's atomic
// count, so the arena may copy its handler under its own lock without holding the GIL.
struct PyCallable {
  py::object fn;
  ~PyCallable() {
    py::gil_scoped_acquire gil;
    fn = py::object();
  }
};

py::dict stats_dict(const ArenaStats& s) {
  py::dict d;
  d["budget_bytes"] = s.budget;
  d["allocated_bytes.current"] = s.allocated_bytes;
  d["allocated_bytes.peak"] = s.peak_allocated_bytes;
  d["requested_bytes.current"] = s.requested_bytes;
  d["pinned_bytes.current"] = s.pinned_bytes;
  d["free_bytes"] = s.free_bytes;
  d["largest_free_block"] = s.largest_free_block;
  d["num_blocks"] = s.num_blocks;
  d["num_allocated_blocks"] = s.num_allocated_blocks;
  d["num_allocs"] = s.num_allocs;
  d["num_frees"] = s.num_frees;
  d["num_pressure_events"] = s.num_pressure_events;
  d["num_released_blocks"] = s.num_released_blocks;
  d["released_bytes"] = s.released_bytes;
  d["num_searches"] = s.num_searches;
  d["num_ooms"] = s.num_ooms;
  d["search_seconds"] = double(s.search_ns) * 1e-9;
  d["num_compactions"] = s.num_compactions;
  d["num_moved_blocks"] = s.num_moved_blocks;
  d["moved_bytes"] = s.moved_bytes;
  d["num_placed_as_planned"] = s.num_placed_as_planned;
  d["num_displaced_from_plan"] = s.num_displaced_from_plan;
  // Fragmentation three ways: now (1 - largest free / total free), GMLake's (1 - peak / budget),
  // and Coop's (free bytes / budget at each pressure event, averaged).
  d["fragmentation.largest_free"] =
      s.free_bytes ? 1.0 - double(s.largest_free_block) / double(s.free_bytes) : 0.0;
  d["fragmentation.peak"] = 1.0 - double(s.peak_allocated_bytes) / double(s.budget);
  d["fragmentation.pressure"] =
      s.num_pressure_events ? s.pressure_free_ratio_sum / double(s.num_pressure_events) : 0.0;
  return d;
}

}  // namespace

py::handle out_of_budget_class() {
  return py::handle(g_out_of_budget ? g_out_of_budget : PyExc_MemoryError);
}

void set_out_of_budget_class(py::object cls) {
  if (!PyType_Check(cls.ptr()) || !PyObject_IsSubclass(cls.ptr(), PyExc_BaseException))
    throw py::type_error("the out-of-budget error must be an exception class");
  Py_XDECREF(g_out_of_budget);
  g_out_of_budget = cls.release().ptr();
}

py::object out_of_budget_error(const OutOfBudget& e) {
  py::object cls = py::reinterpret_borrow<py::object>(out_of_budget_class());
  py::object err = cls(e.what());
  err.attr("requested") = e.requested;
  err.attr("budget") = e.budget;
  err.attr("allocated") = e.allocated;
  err.attr("pinned_bytes") = e.pinned;
  err.attr("largest_free_block") = e.largest_free;
  return err;
}

void set_python_out_of_budget(const OutOfBudget& e) {
  py::object err = out_of_budget_error(e);
  PyErr_SetObject(out_of_budget_class().ptr(), err.ptr());
}

void register_error_translators() {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OutOfBudget& e) {
      set_python_out_of_budget(e);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
}

void bind_arena(py::module_& m) {
  register_error_translators();
  m.def("set_allocation_class",
        [](const std::string& cls) {
          const CostClass previous = thread_allocation_class();
          set_thread_allocation_class(parse_cost_class(cls));
          return std::string(previous == CostClass::Cheap ? "cheap" : "costly");
        },
        py::arg("cost_class"),
        "Placement class ('costly' or 'cheap') of this thread's allocations through pymem's allocator hooks; "
        "returns the previous one.");
  m.def("_set_out_of_budget_error", &set_out_of_budget_class, "Register the class raised when a request cannot be met.");
  m.attr("ALIGNMENT") = kAlignment;
  m.attr("DEFAULT_SMALL_THRESHOLD") = kDefaultSmallThreshold;

  py::class_<Victim>(m, "Victim", "A block the pressure handler is asked to release.")
      .def_readonly("owner", &Victim::owner)
      .def_readonly("addr", &Victim::addr)
      .def_readonly("size", &Victim::size)
      .def_readonly("cost", &Victim::cost)
      .def("__repr__", [](const Victim& v) {
        return "Victim(owner=" + std::to_string(v.owner) + ", addr=" + std::to_string(v.addr) +
               ", size=" + std::to_string(v.size) + ", cost=" + std::to_string(v.cost) + ")";
      });

  py::class_<Window>(m, "Window", "Address-contiguous releasable blocks covering a request, of least cost.")
      .def_readonly("addr", &Window::addr)
      .def_readonly("bytes", &Window::bytes)
      .def_readonly("cost", &Window::cost)
      .def_readonly("victims", &Window::victims)
      .def_property_readonly("owners", [](const Window& w) {
        std::vector<uint64_t> o;
        for (const Victim& v : w.victims) o.push_back(v.owner);
        return o;
      })
      .def("__repr__", [](const Window& w) {
        return "Window(addr=" + std::to_string(w.addr) + ", bytes=" + std::to_string(w.bytes) +
               ", cost=" + std::to_string(w.cost) + ", victims=" + std::to_string(w.victims.size()) + ")";
      });

  py::class_<Block>(m, "Block", "A copy of one arena block (see Arena.blocks).")
      .def_readonly("addr", &Block::addr)
      .def_readonly("size", &Block::size)
      .def_readonly("allocated", &Block::allocated)
      .def_readonly("owner", &Block::owner)
      .def_readonly("cost", &Block::cost)
      .def_readonly("pinned", &Block::pinned)
      .def_readonly("requested", &Block::requested)
      .def_property_readonly("region", [](const Block& b) {
        return b.region == RegionKind::Main ? "main" : "small";
      });

  py::class_<Arena, std::shared_ptr<Arena>>(m, "Arena", R"doc(
One range of exactly `budget` bytes, cut into 512-byte-aligned blocks in address order.

Arena(budget, backing="host", small_threshold=16384, small_region=None, search="window", device=0,
      cuda_table=0)
  backing: "host" (an mmap'd slab, pages committed on touch), "virtual" (addresses only, no
  memory: for simulation and tests) or "cuda" (one cudaMalloc slab on `device`, through the CUDA
  runtime table at address `cuda_table`; its moves are device-to-device copies on the stream given to set_move_stream). Requests <= small_threshold bytes go to a small region at the
  top of the range (small_region bytes; default budget/256, at most 64 MiB) that eviction never scans.
  search: "window" (Coop's cheapest contiguous window), "one_at_a_time" (cheapest single block), or
  "handler" (no search: the pressure handler chooses alone and gets window=None).
)doc")
      .def(py::init([](long long budget, const std::string& backing, long long small_threshold,
                       py::object small_region, const std::string& search, int device,
                       uintptr_t cuda_table) {
             if (budget <= 0)
               throw InvalidArgument("budget must be a positive number of bytes, got " + std::to_string(budget));
             if (small_threshold < 0)
               throw InvalidArgument("small_threshold must be >= 0, got " + std::to_string(small_threshold));
             ArenaConfig c;
             c.budget = size_t(budget);
             c.small_threshold = size_t(small_threshold);
             if (!small_region.is_none()) {
               long long sr = small_region.cast<long long>();
               if (sr < 0) throw InvalidArgument("small_region must be >= 0, got " + std::to_string(sr));
               c.small_region = size_t(sr);
             }
             c.mode = parse_mode(search);
             if (backing != "cuda") return std::shared_ptr<Arena>(make_arena(backing, c));
             if (!cuda_table)
               throw InvalidArgument("a 'cuda' arena needs cuda_table: the address of the CUDA runtime table "
                                     "(pymem.cuda_lib.load().runtime_table())");
             if (device < 0) throw InvalidArgument("device must be >= 0, got " + std::to_string(device));
             check_budget(c.budget);
             return std::make_shared<Arena>(
                 make_cuda_backing(c.budget, device, reinterpret_cast<const pymem_cuda_table*>(cuda_table)), c);
           }),
           py::arg("budget"), py::arg("backing") = "host", py::arg("small_threshold") = kDefaultSmallThreshold,
           py::arg("small_region") = py::none(), py::arg("search") = "window", py::arg("device") = 0,
           py::arg("cuda_table") = 0)
      .def("allocate",
           [](Arena& a, long long nbytes, const std::string& cost_class, uint64_t owner, double cost,
              bool pinned) {
             size_t n = check_size(nbytes, "allocation size");
             CostClass cls = parse_cost_class(cost_class);
             py::gil_scoped_release nogil;
             return a.allocate(n, cls, owner, cost, pinned);
           },
           py::arg("nbytes"), py::arg("cost_class") = "costly", py::arg("owner") = 0, py::arg("cost") = 0.0,
           py::arg("pinned") = false,
           "Allocate nbytes (rounded up to 512); returns the address. Under pressure the handler is "
           "called; raises OutOfBudgetError when nothing more can be released.")
      .def("free", [](Arena& a, uintptr_t addr) { a.free(addr); }, py::arg("addr"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_owner", &Arena::set_owner, py::arg("addr"), py::arg("owner"), py::arg("cost") = 0.0,
           "Give an allocated block an owner id (0 = not releasable) and a release cost.")
      .def("set_cost", &Arena::set_cost, py::arg("addr"), py::arg("cost"))
      .def("set_pinned", &Arena::set_pinned, py::arg("addr"), py::arg("pinned"),
           "Pinned blocks are never put in a window (e.g. inputs of the running op).")
      .def("block_size", &Arena::block_size, py::arg("addr"))
      .def_property_readonly("largest_free_block", &Arena::largest_free_block,
                             "The main region's largest free block (bytes).")
      .def_property_readonly("main_free_bytes", &Arena::main_free_bytes,
                             "The main region's free bytes, in however many blocks.")
      .def("find_window",
           [](Arena& a, long long nbytes) -> py::object {
             Window w = a.find_window(check_size(nbytes, "window size"));
             return w.found ? py::cast(std::move(w)) : py::none();
           },
           py::arg("nbytes"), "The window the pressure protocol would release for nbytes now, or None.")
      .def("compact", &Arena::compact, py::arg("addrs"),
           "Slide the listed blocks up past free space (not past unlisted blocks), moving their bytes;\n"
           "returns [(old_addr, new_addr)] for those that moved. Callers repoint their owners.")
      .def("plan_moves",
           [](const Arena& a, long long request, const std::vector<uintptr_t>& movable,
              const std::vector<uintptr_t>& freed) -> py::object {
             const std::unordered_set<uintptr_t> m(movable.begin(), movable.end()), f(freed.begin(), freed.end());
             std::optional<MovePlan> p = plan_moves(a.blocks(), m, f, check_size(request, "request"));
             if (!p) return py::none();
             return py::make_tuple(p->segment_movable, p->moves, p->window, p->bytes_to_move);
           },
           py::arg("request"), py::arg("movable"), py::arg("freed") = std::vector<uintptr_t>{},
           "The compaction by moves alone that makes `request` fit (move_plan.h): (the chosen segment's\n"
           "movable addresses, [(from, to)] moves, the addresses to slide after them, bytes moved in\n"
           "all), or None. `movable`: addresses of blocks that may move; `freed`: allocated blocks to\n"
           "count as free.")
      .def("plan_compaction",
           [](const Arena& a, long long request, const std::vector<uintptr_t>& movable,
              const std::vector<uintptr_t>& order, const py::function& cost_of) -> py::object {
             const std::unordered_set<uintptr_t> m(movable.begin(), movable.end());
             std::optional<CompactionPlan> p = plan_compaction(
                 a.blocks(), m, {}, order, check_size(request, "request"),
                 [&cost_of](size_t i) { return cost_of(i).cast<double>(); });
             if (!p) return py::none();
             return py::make_tuple(p->moves.segment_movable, p->moves.moves, p->moves.window,
                                   p->moves.bytes_to_move, p->released);
           },
           py::arg("request"), py::arg("movable"), py::arg("order"), py::arg("cost_of"),
           "The compaction that makes `request` fit, releasing in the chosen segment where moves alone\n"
           "fall short (move_plan.h): as plan_moves, plus the indices into `order` (addresses of\n"
           "releasable blocks, lowest score first) to release before sliding; or None. `cost_of(i)`:\n"
           "what releasing order[i] costs (asked only for the releases a candidate takes).")
      .def("release_path",
           [](const Arena& a, long long request, const std::vector<uintptr_t>& order) -> py::tuple {
             std::vector<size_t> taken;
             const ReleasePath how = release_path(a.blocks(), order, check_size(request, "request"), taken);
             static const char* names[] = {"fits", "reached", "never"};
             return py::make_tuple(taken, names[static_cast<int>(how)]);
           },
           py::arg("request"), py::arg("order"),
           "Releasing the blocks at `order`'s addresses one at a time until `request` fits (move_plan.h):\n"
           "(indices into order released, \"fits\" | \"reached\" (their bytes covered it first) | \"never\").")
      .def("move_block", &Arena::move_block, py::arg("from_addr"), py::arg("to_addr"),
           "Move one allocated block's bytes to to_addr, inside one free block; frees the old range.")
      .def("set_move_stream", &Arena::set_move_stream, py::arg("stream"),
           "The cudaStream_t (as an int; 0: the legacy default stream) that a CUDA arena's moves are\n"
           "queued on: kernels queued there before a move read the old bytes, those after it the new.")
      .def("set_pressure_handler",
           [](Arena& a, py::object fn) {
             if (fn.is_none()) return a.set_pressure_handler(nullptr);
             if (!PyCallable_Check(fn.ptr()))
               throw py::type_error("pressure handler must be callable(request_bytes, window) or None");
             auto holder = std::make_shared<PyCallable>();
             holder->fn = std::move(fn);
             a.set_pressure_handler([holder](size_t request, const Window& w) {
               py::gil_scoped_acquire gil;
               // A copy (the handler may keep it); None when the arena did not search (mode "handler").
               holder->fn(request, w.found ? py::cast(Window(w)) : py::none());
             });
           },
           py::arg("handler"),
           "handler(request_bytes, window) is called (GIL held, arena lock free) when a request finds "
           "no fit; it should release blocks (free them), after which the arena retries.")
      .def_property("search", [](const Arena& a) { return mode_name(a.mode()); },
                    [](Arena& a, const std::string& s) { a.set_mode(parse_mode(s)); })
      .def_property("step_placement", &Arena::step_placement, &Arena::set_step_placement,
                    "Whether each step's large blocks go where the step before showed they block nothing\n"
                    "later (step_placement.h); turning it off forgets what was learned.")
      .def("set_step_placement_keeps_plan", &Arena::set_step_placement_keeps_plan, py::arg("keep"),
           "Whether the step now starting keeps its placement plan through a displacement (a block\n"
           "goes where the plan keeps room for it; default) or leaves it for best fit (step_placement.h).")
      .def(
          "end_step",
          [](Arena& a, std::optional<std::vector<std::pair<uintptr_t, size_t>>> next_start) {
            if (next_start) a.end_step(*next_start);
            else a.end_step();
          },
          py::arg("next_start") = py::none(),
          "A training step ended: the step placement plans the next from it (nothing while off), around\n"
          "the blocks allocated now, or around `next_start`, [(address, size)]: the blocks the next step\n"
          "starts with, for a replay that starts each step afresh (the simulator).")
      .def("step_placement_plan", &Arena::step_placement_plan,
           "The step placement's plan for the next step: (offsets, sizes), one per large allocation in\n"
           "order, offset -1 where best fit decides. Step placement must be on.")
      .def("set_step_placement_plan", &Arena::set_step_placement_plan, py::arg("offsets"), py::arg("sizes"),
           "Take over a plan (step_placement_plan() of an arena of the same budget that ran the step) for\n"
           "the step now starting: how the simulator carries placement from one replay's arena to the next.")
      .def("stats", [](const Arena& a) { return stats_dict(a.stats()); })
      .def("reset_peak_memory_stats", &Arena::reset_peak)
      .def(
          "mark_op", [](Arena& a) { const Arena::OpMark m = a.mark_op(); return std::make_pair(m.allocated, m.released); },
          "Before an op's kernel: (allocated bytes, bytes released by pressure so far), for transient_since.")
      .def(
          "transient_since",
          [](const Arena& a, std::pair<size_t, uint64_t> mark) { return a.transient_since({mark.first, mark.second}); },
          py::arg("mark"),
          "After the kernel: the bytes it held at its peak above what it started and ended with (its temporaries).")
      .def("blocks", &Arena::blocks, "Copies of every block, in address order.")
      .def("set_history", &Arena::set_history, py::arg("max_entries"),
           "Record allocations and frees (newest max_entries kept); 0 stops and drops the log.")
      .def_property_readonly("recording_history", &Arena::recording_history)
      .def("history", [](const Arena& a) {
             py::list out;
             for (const HistoryEvent& e : a.history())
               out.append(py::make_tuple(e.action == HistoryEvent::Action::Alloc ? "alloc" : "free_completed",
                                         e.addr, e.size, e.time_us, e.label));
             return out;
           }, "Events, oldest first: (action, addr, size, time_us, label); action is 'alloc' or 'free_completed'.")
      .def("label_next_free", &Arena::label_next_free, py::arg("addr"), py::arg("label"),
           "The next free of addr gets this label in the history (an eviction).")
      .def("label_last_alloc", &Arena::label_last_alloc, py::arg("addr"), py::arg("label"),
           "The newest allocation of addr gets this label in the history (a rematerialization).")
      .def("history_note", [](Arena& a, const std::string& action, uintptr_t addr, size_t size, std::string label) {
             if (action != "alloc" && action != "free_completed")
               throw py::value_error("history_note: action must be 'alloc' or 'free_completed', got '" + action + "'");
             a.history_note(action == "alloc" ? HistoryEvent::Action::Alloc : HistoryEvent::Action::Free, addr, size,
                            std::move(label));
           }, py::arg("action"), py::arg("addr"), py::arg("size"), py::arg("label"),
           "An event the arena does not see itself (the two halves of a compaction move).")
      .def_property_readonly("num_allocs", [](const Arena& a) { return a.stats().num_allocs; },
                             "Allocations served so far (cheaper than stats()).")
      .def_property_readonly("base", &Arena::base)
      .def_property_readonly("budget", &Arena::budget)
      .def_property_readonly("small_threshold", &Arena::small_threshold)
      .def_property_readonly("small_region_size", &Arena::small_region_size)
      .def_property_readonly("backing", &Arena::backing_kind);

  m.def("_bench_arena_pairs", &bench_arena_pairs, py::arg("live_blocks"), py::arg("pairs"), py::arg("seed") = 0,
        py::call_guard<py::gil_scoped_release>(), "ns per allocate+free pair with live_blocks live.");
  m.def("_bench_malloc_pairs", &bench_malloc_pairs, py::arg("live_blocks"), py::arg("pairs"), py::arg("seed") = 0,
        py::call_guard<py::gil_scoped_release>(), "The same pattern against glibc malloc/free.");
  m.def("_bench_window_search", &bench_window_search, py::arg("blocks"), py::arg("searches"), py::arg("seed") = 0,
        py::call_guard<py::gil_scoped_release>(), "us per window search over `blocks` blocks.");
}

}  // namespace pymem
