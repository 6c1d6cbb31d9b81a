// Keeps the native library non-empty before every part of it has a .cpp file.
namespace mbs::native {
const char* native_core_name() { return "mbs_ext native core"; }
}  // namespace mbs::native
