// llama.cpp side of tools/interop/check-llama.sh: prompt ids in one batch, then a greedy run with llama.cpp, logits of every row to a raw f32 file.
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include <sstream>
int main(int argc, char** argv) {
  if (argc < 5) { fprintf(stderr, "usage: model ids n_gen out.f32\n"); return 2; }
  std::vector<llama_token> ids; { std::stringstream ss(argv[2]); std::string t; while (std::getline(ss, t, ',')) ids.push_back(std::atoi(t.c_str())); }
  int n_gen = std::atoi(argv[3]);
  llama_backend_init();
  auto mp = llama_model_default_params(); mp.use_extra_bufts = false;
  llama_model* m = llama_model_load_from_file(argv[1], mp); if (!m) return 3;
  auto cp = llama_context_default_params(); cp.n_ctx = 512; cp.n_batch = 512; cp.n_ubatch = 512; cp.n_threads = 2; cp.n_threads_batch = 2;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  llama_context* c = llama_init_from_model(m, cp); if (!c) return 4;
  int V = llama_vocab_n_tokens(llama_model_get_vocab(m));
  FILE* out = fopen(argv[4], "wb");
  llama_batch b = llama_batch_init(512, 0, 1);
  b.n_tokens = ids.size();
  for (size_t i = 0; i < ids.size(); ++i) { b.token[i] = ids[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1; }
  if (llama_decode(c, b)) return 5;
  int pos = ids.size(); llama_token next = 0;
  auto row = [&](int i) { float* l = llama_get_logits_ith(c, i); fwrite(l, 4, V, out); int best = 0; for (int k = 1; k < V; ++k) if (l[k] > l[best]) best = k; return best; };
  for (size_t i = 0; i < ids.size(); ++i) next = row(i);
  printf("gen:");
  for (int s = 0; s < n_gen; ++s) {
    printf(" %d", next);
    b.n_tokens = 1; b.token[0] = next; b.pos[0] = pos++; b.n_seq_id[0] = 1; b.seq_id[0][0] = 0; b.logits[0] = 1;
    if (llama_decode(c, b)) return 6;
    next = row(0);
  }
  printf("\n"); fclose(out); return 0;
}
