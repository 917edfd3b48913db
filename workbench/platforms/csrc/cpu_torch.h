// The slice of ATen the kernels use: tensors, TORCH_CHECK, parallel_for and the few ops they
// call. <torch/extension.h> (pybind11 and torch's whole C++ API, about 15 s of parsing a
// file) is included by cpu_attention.cpp alone, where the module's bindings are: a first
// start on a machine builds the kernel while it serves, and that build is what it waits for.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
