// GGUF v3 layout and the streaming writer. The header and the tensor table (canonical offsets,
// 32-byte aligned) are computed before any weight exists; then worker threads generate and quantize
// row chunks in file order and pwrite each chunk at its final offset, so memory stays at a few
// chunk buffers per thread whatever the model size.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "moe/error.hpp"
#include "moe/quant.hpp"
#include "synth.hpp"

namespace synth {

using moe::Error;
using moe::Exit;
using moe::gguf::ValueType;

namespace {

constexpr uint64_t kAlign = 32;  // GGUF's default; no general.alignment key is written
uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

struct Buf {
  std::vector<uint8_t> b;
  void raw(const void* p, size_t n) {
    if (n == 0) return;
    const size_t at = b.size();
    b.resize(at + n);
    std::memcpy(b.data() + at, p, n);
  }
  void u32(uint32_t v) { raw(&v, 4); }
  void i32(int32_t v) { raw(&v, 4); }
  void u64(uint64_t v) { raw(&v, 8); }
  void f32(float v) { raw(&v, 4); }
  void str(std::string_view s) {
    u64(s.size());
    raw(s.data(), s.size());
  }
  void key(std::string_view k, ValueType t) {
    str(k);
    u32(static_cast<uint32_t>(t));
  }
};

struct Meta {
  Buf buf;
  uint64_t count = 0;
  void kv_u32(std::string_view k, uint32_t v) { buf.key(k, ValueType::UINT32), buf.u32(v), ++count; }
  void kv_f32(std::string_view k, float v) { buf.key(k, ValueType::FLOAT32), buf.f32(v), ++count; }
  void kv_bool(std::string_view k, bool v) {
    buf.key(k, ValueType::BOOL);
    buf.b.push_back(v ? 1 : 0);
    ++count;
  }
  void kv_str(std::string_view k, std::string_view v) { buf.key(k, ValueType::STRING), buf.str(v), ++count; }
  void kv_strs(std::string_view k, const std::vector<std::string>& v) {
    buf.key(k, ValueType::ARRAY);
    buf.u32(static_cast<uint32_t>(ValueType::STRING));
    buf.u64(v.size());
    for (const auto& s : v) buf.str(s);
    ++count;
  }
  void kv_i32s(std::string_view k, const std::vector<int32_t>& v) {
    buf.key(k, ValueType::ARRAY);
    buf.u32(static_cast<uint32_t>(ValueType::INT32));
    buf.u64(v.size());
    buf.raw(v.data(), v.size() * 4);
    ++count;
  }
};

Meta metadata(const Geometry& g, const Vocab& v, const WriteOptions& opt) {
  Meta m;
  const std::string a = "qwen3moe.";
  m.kv_str("general.architecture", "qwen3moe");
  m.kv_str("general.name", opt.name);
  m.kv_u32("general.file_type", mix_file_type(opt.mix));
  m.kv_u32("general.quantization_version", 2);
  m.kv_u32(a + "context_length", g.context_length);
  m.kv_u32(a + "embedding_length", g.n_embd);
  m.kv_u32(a + "feed_forward_length", g.expert_ffn * g.n_expert_used);
  m.kv_u32(a + "block_count", g.n_layer);
  m.kv_u32(a + "attention.head_count", g.n_head);
  m.kv_u32(a + "attention.head_count_kv", g.n_head_kv);
  m.kv_u32(a + "attention.key_length", g.head_dim);
  m.kv_u32(a + "attention.value_length", g.head_dim);
  m.kv_f32(a + "attention.layer_norm_rms_epsilon", g.rms_eps);
  m.kv_f32(a + "rope.freq_base", g.rope_base);
  m.kv_u32(a + "expert_count", g.n_expert);
  m.kv_u32(a + "expert_used_count", g.n_expert_used);
  m.kv_u32(a + "expert_feed_forward_length", g.expert_ffn);
  m.kv_str("tokenizer.ggml.model", v.model);
  m.kv_str("tokenizer.ggml.pre", v.pre);
  m.kv_strs("tokenizer.ggml.tokens", v.tokens);
  m.kv_i32s("tokenizer.ggml.token_type", v.token_type);
  m.kv_strs("tokenizer.ggml.merges", v.merges);
  m.kv_u32("tokenizer.ggml.bos_token_id", v.bos);
  m.kv_u32("tokenizer.ggml.eos_token_id", v.eos);
  m.kv_u32("tokenizer.ggml.padding_token_id", v.pad);
  m.kv_bool("tokenizer.ggml.add_bos_token", false);
  m.kv_str("tokenizer.chat_template", v.chat_template);
  return m;
}

void pwrite_all(int fd, const uint8_t* p, size_t n, uint64_t off, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(off));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0)
      throw Error(Exit::other, fmt::format("{}: write failed at offset {}: {}", path, off, std::strerror(errno)));
    p += w;
    n -= static_cast<size_t>(w);
    off += static_cast<uint64_t>(w);
  }
}

struct Chunk {
  uint32_t tensor;
  int64_t row0, row1;
};

// Writes one row of n floats as `type`.
void encode_row(Type type, const float* src, uint8_t* dst, int64_t n) {
  if (type == Type::F32)
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
  else
    moe::quant::quantize_row(type, src, dst, n);
}

// fn(task) for every task in [0, n) on `threads` threads; the first exception is rethrown.
template <typename Fn>
void parallel_for(int64_t n, int threads, Fn fn) {
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex mu;
  auto work = [&] {
    try {
      for (int64_t i; (i = next.fetch_add(1)) < n;) fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = std::current_exception();
      next = n;
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

// The encoded chunk pools of the pooled tensors, one per (type, scale).
struct Pools {
  int64_t n_chunks = 0;
  std::map<std::pair<uint32_t, float>, std::vector<uint8_t>> by_key;
  std::vector<const uint8_t*> of_tensor;  // per tensor; nullptr when not pooled
};

Pools build_pools(const Geometry& g, const std::vector<TensorPlan>& tensors, uint64_t seed, int threads) {
  // Few enough chunks that each pool stays a few MB and is quantized in a second.
  constexpr int64_t kMaxPoolChunks = 32768;
  Pools p;
  // Whether to pool depends on the geometry only, so files of different types hold the same values.
  std::map<std::pair<uint32_t, float>, int64_t> slots;
  int64_t total = 0;
  for (const auto& t : tensors)
    if (is_pooled(g, t)) {
      slots[{static_cast<uint32_t>(t.type), pooled_scale(g, t)}] += 1;
      total += t.rows() * (t.ne[0] / kPoolChunk);
    }
  p.of_tensor.assign(tensors.size(), nullptr);
  // Small models are generated element by element: quantizing them directly costs less than a pool.
  if (total <= 4 * kMaxPoolChunks) return p;
  p.n_chunks = kMaxPoolChunks;
  const std::vector<float> unit = make_unit_pool(seed, p.n_chunks);
  std::vector<std::pair<std::pair<uint32_t, float>, std::vector<uint8_t>*>> keys;
  for (const auto& [k, n] : slots) {
    auto& buf = p.by_key[k];
    buf.resize(moe::gguf::row_bytes(static_cast<Type>(k.first), kPoolChunk) * static_cast<size_t>(p.n_chunks));
    keys.emplace_back(k, &buf);
  }
  constexpr int64_t kPerTask = 256;
  const int64_t per_key = (p.n_chunks + kPerTask - 1) / kPerTask;
  parallel_for(static_cast<int64_t>(keys.size()) * per_key, threads, [&](int64_t task) {
    const auto& [key, buf] = keys[static_cast<size_t>(task / per_key)];
    const Type type = static_cast<Type>(key.first);
    const size_t cb = moe::gguf::row_bytes(type, kPoolChunk);
    float scaled[kPoolChunk];
    const int64_t c0 = (task % per_key) * kPerTask, c1 = std::min(p.n_chunks, c0 + kPerTask);
    for (int64_t c = c0; c < c1; ++c) {
      for (int64_t i = 0; i < kPoolChunk; ++i) scaled[i] = unit[static_cast<size_t>(c * kPoolChunk + i)] * key.second;
      encode_row(type, scaled, buf->data() + cb * static_cast<size_t>(c), kPoolChunk);
    }
  });
  for (size_t i = 0; i < tensors.size(); ++i)
    if (is_pooled(g, tensors[i]))
      p.of_tensor[i] =
          p.by_key.at({static_cast<uint32_t>(tensors[i].type), pooled_scale(g, tensors[i])}).data();
  return p;
}

void print_progress(uint64_t done, uint64_t total, double secs, bool final) {
  const double frac = total ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
  constexpr int kWidth = 30;
  const int fill = static_cast<int>(frac * kWidth);
  const double rate = secs > 0 ? static_cast<double>(done) / secs : 0.0;
  const double eta = rate > 0 ? static_cast<double>(total - done) / rate : 0.0;
  std::fprintf(stderr, "\r[%.*s%*s] %5.1f%% %7.2f / %.2f GiB  %6.0f MiB/s  %s %4.0fs ", fill,
               "##############################", kWidth - fill, "", frac * 100.0, done / 1073741824.0,
               total / 1073741824.0, rate / 1048576.0, final ? "took" : "ETA", final ? secs : eta);
  if (final) std::fputc('\n', stderr);
  std::fflush(stderr);
}

}  // namespace

WriteStats write_model(const Geometry& g, const Vocab& v, std::vector<TensorPlan>& tensors,
                       const WriteOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  Meta meta = metadata(g, v, opt);

  // Canonical offsets: each tensor starts at the aligned end of the previous one.
  uint64_t data_bytes = 0;
  for (auto& t : tensors) {
    t.offset = data_bytes;
    data_bytes = align_up(data_bytes + t.nbytes, kAlign);
  }
  Buf head;
  head.raw("GGUF", 4);
  head.u32(3);
  head.u64(tensors.size());
  head.u64(meta.count);
  head.raw(meta.buf.b.data(), meta.buf.b.size());
  meta.buf.b.clear();
  meta.buf.b.shrink_to_fit();
  for (const auto& t : tensors) {
    head.str(t.name);
    head.u32(t.n_dims);
    for (uint32_t d = 0; d < t.n_dims; ++d) head.u64(static_cast<uint64_t>(t.ne[d]));
    head.u32(static_cast<uint32_t>(t.type));
    head.u64(t.offset);
  }
  const uint64_t data_start = align_up(head.b.size(), kAlign);
  const uint64_t file_bytes = data_start + data_bytes;

  const std::string tmp = opt.path + ".partial";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(Exit::other, fmt::format("{}: cannot create: {}", tmp, std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  // A failed or interrupted write leaves no half file behind.
  struct Unlinker {
    const std::string& path;
    bool keep = false;
    ~Unlinker() {
      if (!keep) ::unlink(path.c_str());
    }
  } unlinker{tmp};
  // Padding between tensors is whatever ftruncate leaves: zeros.
  if (::ftruncate(fd, static_cast<off_t>(file_bytes)) != 0)
    throw Error(Exit::other, fmt::format("{}: cannot size the file to {} bytes: {}", tmp, file_bytes,
                                         std::strerror(errno)));
  pwrite_all(fd, head.b.data(), head.b.size(), 0, tmp);
  head.b = {};

  const Pools pools = build_pools(g, tensors, opt.seed, std::max(1, opt.threads));

  // Chunks of about 4 MiB of output, in file order so the disk sees a mostly sequential stream.
  constexpr uint64_t kChunkBytes = 4u << 20;
  std::vector<Chunk> chunks;
  for (uint32_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const uint64_t rb = t.nbytes / static_cast<uint64_t>(t.rows());
    const int64_t per = static_cast<int64_t>(std::max<uint64_t>(1, kChunkBytes / rb));
    for (int64_t r = 0; r < t.rows(); r += per) chunks.push_back({i, r, std::min(t.rows(), r + per)});
  }

  std::atomic<size_t> next{0};
  std::atomic<uint64_t> done{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mu;
  auto worker = [&] {
    std::vector<float> row;
    std::vector<uint8_t> out;
    std::vector<uint32_t> picks;
    try {
      for (size_t c; !failed.load(std::memory_order_relaxed) && (c = next.fetch_add(1)) < chunks.size();) {
        const Chunk& ch = chunks[c];
        const TensorPlan& t = tensors[ch.tensor];
        const size_t rb = moe::gguf::row_bytes(t.type, t.ne[0]);
        row.resize(static_cast<size_t>(t.ne[0]));
        out.resize(rb * static_cast<size_t>(ch.row1 - ch.row0));
        const uint8_t* pool = pools.of_tensor[ch.tensor];
        const size_t cb = pool ? moe::gguf::row_bytes(t.type, kPoolChunk) : 0;
        picks.resize(static_cast<size_t>(t.ne[0] / kPoolChunk));
        for (int64_t r = ch.row0; r < ch.row1; ++r) {
          uint8_t* dst = out.data() + rb * static_cast<size_t>(r - ch.row0);
          if (pool) {
            pooled_row(opt.seed, t, r, pools.n_chunks, picks.data());
            for (size_t j = 0; j < picks.size(); ++j)
              std::memcpy(dst + j * cb, pool + cb * picks[j], cb);
          } else {
            generate_row(g, t, opt.seed, r, row.data());
            encode_row(t.type, row.data(), dst, t.ne[0]);
          }
        }
        pwrite_all(fd, out.data(), out.size(), data_start + t.offset + rb * static_cast<uint64_t>(ch.row0), tmp);
        done.fetch_add(out.size(), std::memory_order_relaxed);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = std::current_exception();
      failed = true;
    }
  };
  std::vector<std::thread> pool;
  const int n_threads = std::max(1, opt.threads);
  for (int i = 0; i < n_threads; ++i) pool.emplace_back(worker);
  auto secs = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  if (opt.progress) {
    uint64_t total = 0;
    for (const auto& t : tensors) total += t.nbytes;
    while (done.load() < total && !failed.load()) {
      print_progress(done.load(), total, secs(), false);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    for (auto& th : pool) th.join();
    if (!failed) print_progress(done.load(), total, secs(), true);
  } else {
    for (auto& th : pool) th.join();
  }
  if (error) std::rethrow_exception(error);
  if (::rename(tmp.c_str(), opt.path.c_str()) != 0)
    throw Error(Exit::other, fmt::format("{}: cannot rename to {}: {}", tmp, opt.path, std::strerror(errno)));
  unlinker.keep = true;
  return WriteStats{file_bytes, data_bytes, secs()};
}

}  // namespace synth
