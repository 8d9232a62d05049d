"""The driver-level runtime: NVRTC compile + disk cache, module load, launch, TMA maps, device info, interop."""
from .compiler import CompileError, CompileReport, Compiled, cache_dir, compile_kernel, nvrtc_version, ptx_dir
from .driver import (CudaError, DeviceProperties, NoDeviceError, check, device_context, device_properties,
                     enter_device, gpu_available, leave_device, require_gpu, smem_stages, stream_handle, target_arch,
                     use_device)
from .interop import DeviceArray, HostArrayError, as_array, require, same_device
from .launch import Function, Launcher, get_launcher, load
from .tensormap import AddressedMapCache, TensorMap, check_tensor_map, encode_tensor_map

__all__ = [
    "CompileError", "CompileReport", "Compiled", "cache_dir", "compile_kernel", "nvrtc_version", "ptx_dir",
    "CudaError", "DeviceProperties", "NoDeviceError", "check", "device_context", "device_properties", "enter_device",
    "gpu_available", "leave_device", "require_gpu", "smem_stages", "stream_handle", "target_arch", "use_device",
    "DeviceArray", "HostArrayError", "as_array", "require", "same_device",
    "Function", "Launcher", "get_launcher", "load",
    "AddressedMapCache", "TensorMap", "check_tensor_map", "encode_tensor_map",
]
