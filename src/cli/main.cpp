// moe-run entry point: flags -> RunConfig, errors -> the exit codes of CLI.md.
#include <iostream>
#include <new>

#include "moe/error.hpp"
#include "moe/run.hpp"
#include "options.hpp"

int main(int argc, char** argv) {
  moe::run::install_signal_handlers();
  try {
    moe::cli::Request req;
    if (auto rc = moe::cli::parse(argc, argv, req, std::cout)) return *rc;
    switch (req.action) {
      case moe::cli::Action::inspect: return moe::run::inspect(req.cfg, req.json, std::cout);
      case moe::cli::Action::tokenize: return moe::run::tokenize(req.cfg, std::cout, std::cerr);
      case moe::cli::Action::generate: break;
    }
    const moe::run::Backends backends = moe::run::backends_from_env();
    return moe::run::generate(req.cfg, backends, std::cout, std::cerr);
  } catch (const moe::Error& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return static_cast<int>(e.code());
  } catch (const std::bad_alloc&) {
    std::cerr << "error: out of memory" << std::endl;
    return static_cast<int>(moe::Exit::resources);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return static_cast<int>(moe::Exit::other);
  } catch (...) {
    std::cerr << "error: unknown failure" << std::endl;
    return static_cast<int>(moe::Exit::other);
  }
}
