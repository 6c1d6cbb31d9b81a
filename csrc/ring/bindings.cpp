// pybind11 bindings of StreamRing / RingIterator and the balanced split. Blocking calls release the GIL: the
// worker thread never needs it, and the consumer may wait for data. Compiled inside csrc/module.cpp.
#include <torch/csrc/utils/pybind.h>

#include "ring/core/thread_name.h"
#include "ring/stream_ring.h"

namespace mbs {

namespace py = pybind11;

void bind_stream_ring(py::module_& m) {
  m.def("split_sizes", &ring_core::split_sizes, py::arg("rows"), py::arg("micro_batch_size"),
        "Balanced micro-batch sizes (the ring's rule; mbs_ext.batch.split_sizes is the same)");
  m.attr("ring_thread_names") =
      py::make_tuple(ring_core::kProducerThreadName, ring_core::kStagingThreadName);
  py::class_<RingIterator, std::shared_ptr<RingIterator>>(m, "RingIterator",
                                                      "One stream of micro-batches (use mbs_ext.StreamRing)")
      .def(
          "next",
          [](RingIterator& self) -> std::optional<std::vector<at::Tensor>> {
            std::optional<std::vector<at::Tensor>> out;
            {
              py::gil_scoped_release no_gil;
              out = self.next();
            }
            return out;
          },
          "Next micro-batch as a list of tensors (one per batch tensor), None at the end")
      .def("close", &RingIterator::close, py::call_guard<py::gil_scoped_release>(),
           "Stop the worker thread and join it")
      .def_property_readonly("index", &RingIterator::index)
      .def_property_readonly("rows", &RingIterator::rows)
      .def_property_readonly("num_micro_batches", &RingIterator::num_micro_batches)
      .def_property_readonly("closed", &RingIterator::closed);

  py::class_<StreamRing, std::shared_ptr<StreamRing>>(m, "StreamRing",
                                                      "Double-buffered host->device micro-batch ring")
      .def(py::init([](const std::string& device, int slots, int staging_threads) {
             return std::make_shared<StreamRing>(c10::Device(device), slots, staging_threads);
           }),
           py::arg("device"), py::arg("slots") = 2, py::arg("staging_threads") = 1)
      .def("open", &StreamRing::open, py::arg("leaves"), py::arg("micro_batch_size"),
           py::arg("indices") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("close", &StreamRing::close, py::call_guard<py::gil_scoped_release>())
      .def("stats",
           [](const StreamRing& self) {
             auto s = self.stats();
             py::dict d;
             d["stage_s"] = static_cast<double>(s->stage_ns.load()) * 1e-9;
             d["wait_s"] = static_cast<double>(s->wait_ns.load()) * 1e-9;
             d["micro_batches"] = s->micro_batches.load();
             d["bytes"] = s->bytes.load();
             d["staged_bytes"] = s->staged_bytes.load();
             d["planned_micro_batches"] = s->planned.load();
             return d;
           })
      .def_property_readonly("device", [](const StreamRing& self) { return self.device().str(); })
      .def_property_readonly("slots", &StreamRing::slots)
      .def_property_readonly("staging_threads", &StreamRing::staging_threads);
}

}  // namespace mbs
