// Process behaviour: signals, peak RSS, NPY output.
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>

#include <sys/resource.h>
#include <unistd.h>

#include "moe/error.hpp"
#include "moe/run.hpp"

namespace moe::run {

static std::atomic<bool> g_interrupt{false};

// The first SIGINT asks the decode loop to stop after the current token; a second one (the run is
// stuck in a long load or upload) ends the process at once, still with exit code 130.
extern "C" void moe_on_sigint(int) {
  if (g_interrupt.exchange(true, std::memory_order_relaxed)) _exit(130);
}

void install_signal_handlers() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = moe_on_sigint;
  sigemptyset(&sa.sa_mask);
  // SA_RESTART: a read of the prompt from stdin is not cut short; the flag is polled per token.
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, nullptr);
  // A closed stdout must end the run quietly, not kill it: writes then fail with EPIPE.
  std::signal(SIGPIPE, SIG_IGN);
}

bool interrupt_requested() { return g_interrupt.load(std::memory_order_relaxed); }
void request_interrupt() { g_interrupt.store(true, std::memory_order_relaxed); }
void clear_interrupt() { g_interrupt.store(false, std::memory_order_relaxed); }

double peak_rss_mib() {
  // VmHWM is the peak RSS; ru_maxrss (KiB on Linux) is the same figure when /proc is absent.
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    long kib = -1;
    while (std::fgets(line, sizeof line, f))
      if (std::strncmp(line, "VmHWM:", 6) == 0) kib = std::strtol(line + 6, nullptr, 10);
    std::fclose(f);
    if (kib >= 0) return static_cast<double>(kib) / 1024.0;
  }
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) == 0) return static_cast<double>(ru.ru_maxrss) / 1024.0;
  return 0.0;
}

void write_npy(const std::string& path, const std::vector<float>& data, int64_t rows, int64_t cols) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(rows) + ", " +
                       std::to_string(cols) + "), }";
  // NPY v1: magic(6) + version(2) + header length(2) + header, padded with spaces to a multiple
  // of 64 bytes and ended by a newline.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) fail(Exit::other, "cannot write {}: {}", path, std::strerror(errno));
  const uint16_t hlen = static_cast<uint16_t>(header.size());
  f.write("\x93NUMPY\x01\x00", 8);
  const char hl[2] = {static_cast<char>(hlen & 0xFF), static_cast<char>(hlen >> 8)};
  f.write(hl, 2);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(reinterpret_cast<const char*>(data.data()),
          static_cast<std::streamsize>(static_cast<size_t>(rows * cols) * sizeof(float)));
  f.flush();
  if (!f) fail(Exit::other, "cannot write {}: {}", path, std::strerror(errno));
}

}  // namespace moe::run
