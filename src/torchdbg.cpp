// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// The compiled part of torchdbg (the `torchdbg_compiled` library, CMake target
// `torchdbg::compiled`): the bodies of the main classes for std::mutex and NullMutex, built
// once. A program that links it and defines TORCHDBG_COMPILED_LIB (the target does) compiles
// only declarations of them in each file that includes torchdbg.

#ifndef TORCHDBG_COMPILED_LIB
#define TORCHDBG_COMPILED_LIB
#endif
#define TORCHDBG_BUILDING_LIB
#include "torchdbg/torchdbg.hpp"

namespace torchdbg {

template class BasicTensorInspector<std::mutex>;
template class BasicTensorInspector<detail::NullMutex>;
template class BasicActivationVisualizer<std::mutex>;
template class BasicActivationVisualizer<detail::NullMutex>;
template class detail::HookRegistry<std::mutex>;
template class detail::HookRegistry<detail::NullMutex>;
template class detail::AlertLog<std::mutex>;
template class detail::AlertLog<detail::NullMutex>;
template class detail::StepState<std::mutex, HookManager::Change>;
template class detail::StepState<detail::NullMutex, HookManagerSt::Change>;
template class detail::HookExecutor<std::mutex, detail::StepState<std::mutex, HookManager::Change>>;
template class detail::HookExecutor<detail::NullMutex, detail::StepState<detail::NullMutex, HookManagerSt::Change>>;
template class BasicHookManager<std::mutex>;
template class BasicHookManager<detail::NullMutex>;
template class BasicHealthMonitor<std::mutex>;
template class BasicHealthMonitor<detail::NullMutex>;
template class HealthInstallation<std::mutex, std::mutex>;
template class HealthInstallation<std::mutex, detail::NullMutex>;
template class HealthInstallation<detail::NullMutex, std::mutex>;
template class HealthInstallation<detail::NullMutex, detail::NullMutex>;
template class BasicAttachSession<std::mutex>;
template class BasicAttachSession<detail::NullMutex>;
template HealthInstallation<std::mutex, std::mutex> BasicHealthMonitor<std::mutex>::install(BasicHookManager<std::mutex>&);
template HealthInstallation<std::mutex, detail::NullMutex> BasicHealthMonitor<std::mutex>::install(BasicHookManager<detail::NullMutex>&);
template HealthInstallation<detail::NullMutex, std::mutex> BasicHealthMonitor<detail::NullMutex>::install(BasicHookManager<std::mutex>&);
template HealthInstallation<detail::NullMutex, detail::NullMutex> BasicHealthMonitor<detail::NullMutex>::install(BasicHookManager<detail::NullMutex>&);

}  // namespace torchdbg
