// Placeholder entry point until the CLI lands (src/cli is owned by the run/CLI work).
#include <cstdio>
int main() {
  std::fputs("error: moe-run: generation is not implemented yet\n", stderr);
  return 1;
}
