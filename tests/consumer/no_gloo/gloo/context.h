// Stands in for Gloo's header in the umbrella consumer check: torchdbg/torchdbg.hpp must
// compile with only LibTorch, fmt and nlohmann_json, so reaching Gloo is an error.
#error "torchdbg/torchdbg.hpp reached a Gloo header: the umbrella must not need Gloo"
