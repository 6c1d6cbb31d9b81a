// pybind11 bindings of StreamRing / RingStream. Blocking calls release the GIL: the
// worker thread never needs it, and the consumer may wait for data.
#include "ring/bindings.h"

#include "ring/stream_ring.h"

namespace mbs {

namespace py = pybind11;

void bind_stream_ring(py::module_& m) {
  py::class_<RingStream, std::shared_ptr<RingStream>>(m, "RingStream",
                                                      "One stream of micro-batches (use mbs_ext.StreamRing)")
      .def(
          "next",
          [](RingStream& self) -> std::optional<std::vector<at::Tensor>> {
            std::optional<std::vector<at::Tensor>> out;
            {
              py::gil_scoped_release no_gil;
              out = self.next();
            }
            return out;
          },
          "Next micro-batch as a list of tensors (one per batch tensor), None at the end")
      .def("close", &RingStream::close, py::call_guard<py::gil_scoped_release>(),
           "Stop the worker thread and join it")
      .def_property_readonly("index", &RingStream::index)
      .def_property_readonly("rows", &RingStream::rows)
      .def_property_readonly("num_micro_batches", &RingStream::num_micro_batches)
      .def_property_readonly("closed", &RingStream::closed);

  py::class_<StreamRing, std::shared_ptr<StreamRing>>(m, "StreamRing",
                                                      "Double-buffered host->device micro-batch ring")
      .def(py::init([](const std::string& device, int slots) {
             return std::make_shared<StreamRing>(c10::Device(device), slots);
           }),
           py::arg("device"), py::arg("slots") = 2)
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
             d["planned_micro_batches"] = s->planned.load();
             return d;
           })
      .def_property_readonly("device", [](const StreamRing& self) { return self.device().str(); })
      .def_property_readonly("slots", &StreamRing::slots);
}

}  // namespace mbs
