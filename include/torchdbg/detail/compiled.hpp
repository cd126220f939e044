// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Header-only (the default) or compiled mode.
//
// With `TORCHDBG_COMPILED_LIB` defined (the `torchdbg::compiled` CMake target defines it for
// its users), the headers declare the member functions of torchdbg's main classes and the
// bodies live in the `torchdbg_compiled` library (src/torchdbg.cpp, built once): a file that
// includes torchdbg compiles them no more. `TORCHDBG_DEFINITIONS` says whether a header shows
// its out-of-class definitions; `TORCHDBG_INLINE` marks the non-template ones (`inline` when
// header-only, defined once in the library in compiled mode).

#if defined(TORCHDBG_COMPILED_LIB) && !defined(TORCHDBG_BUILDING_LIB)
#define TORCHDBG_DEFINITIONS 0
#else
#define TORCHDBG_DEFINITIONS 1
#endif

#if defined(TORCHDBG_COMPILED_LIB)
#define TORCHDBG_INLINE
#else
#define TORCHDBG_INLINE inline
#endif

/// In compiled mode, `TORCHDBG_EXTERN_TEMPLATE(class X<std::mutex>)` says that the library
/// holds the instantiation; header-only, it says nothing.
#if defined(TORCHDBG_COMPILED_LIB)
#define TORCHDBG_EXTERN_TEMPLATE(...) extern template __VA_ARGS__;
#else
#define TORCHDBG_EXTERN_TEMPLATE(...)
#endif
