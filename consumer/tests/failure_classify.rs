//! Error classification on real texts: the CPU arena failure this repository provokes (see
//! `pipeline_memory.rs`), and ONNX Runtime CUDA EP / CUDA runtime / cuBLAS / cuDNN texts as
//! users reported them, each with where it was seen. Texts are copied as reported; where a
//! report only quoted part of a line, the part is what is here.

use nvml_wrapper::error::NvmlError;
use shotfleet_consumer::failure::{
    EXIT_CONFIG, EXIT_DRIVER_FAULT, EXIT_NOTHING_FITS, EXIT_RESTART, EXIT_START, EXIT_STORE, ErrorKind, classify_nvml, classify_render, classify_text,
};
use shotfleet_consumer::pipeline::{RenderError, Stage};

/// ORT status codes as numbers (`OrtErrorCode`).
const FAIL: Option<i32> = Some(1);
const RUNTIME_EXCEPTION: Option<i32> = Some(6);

fn kind(code: Option<i32>, text: &str) -> ErrorKind {
    classify_text(code, text)
}

#[test]
fn cpu_arena_out_of_memory_provoked_here() {
    // ONNX Runtime 1.31.1, CPU, tiny fixture, `cpu_arena_max_mem` 64 MiB, 512x512, guidance 6:
    // `RenderError::message()` word for word.
    let text = "Non-zero status code returned while running Softmax node. Name:'/unet/down_blocks.1/attentions.0/transformer_blocks.0/attn1/Softmax' Status Message: /onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:360 void* onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*) Available memory of 28226560 is smaller than requested bytes of 33554432";
    assert_eq!(kind(FAIL, text), ErrorKind::Oom);
}

#[test]
fn cuda_out_of_memory() {
    // microsoft/onnxruntime#9939 (ORT 1.9, CUDA arena, V100).
    let arena = "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running FusedMatMul node. Name:'MatMul_92_FusedMatMulAndScale' Status Message: /onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:331 void* onnxruntime::BFCArena::AllocateRawInternal(size_t, bool) Failed to allocate memory for requested buffer of size 8388608000";
    assert_eq!(kind(RUNTIME_EXCEPTION, arena), ErrorKind::Oom);
    // microsoft/onnxruntime#22702 (ORT 1.19, T4, the newer signature).
    let arena_1_19 = "Non-zero status code returned while running Conv node. Name:'/patch_embed/stages/stages.0/blocks/blocks.0/mlp/fc1/Conv' Status Message: \n/onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:376 void* onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*, bool, onnxruntime::WaitNotificationFn) Failed to allocate memory for requested buffer of size 4585490524328388608";
    assert_eq!(kind(RUNTIME_EXCEPTION, arena_1_19), ErrorKind::Oom);
    // hacksider/Deep-Live-Cam#584 (ORT CUDA EP on Windows).
    let cuda = "[ONNXRuntimeError] : 1 : FAIL : D:\\a\\_work\\1\\s\\onnxruntime\\core\\providers\\cuda\\cuda_call.cc:121 onnxruntime::CudaCall D:\\a\\_work\\1\\s\\onnxruntime\\core\\providers\\cuda\\cuda_call.cc:114 onnxruntime::CudaCall CUDA failure 2: out of memory ; GPU=0 ; hostname=DESKTOP-QUBEI ; file=D:\\a\\_work\\1\\s\\onnxruntime\\core\\providers\\cuda\\cuda_stream_handle.cc ; line=175 ; expr=cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);";
    assert_eq!(kind(FAIL, cuda), ErrorKind::Oom);
    // C0untFloyd/roop-unleashed#1065 (ORT CUDA EP, cuBLAS handle creation).
    let cublas = "D:\\a\\_work\\1\\s\\onnxruntime\\core\\providers\\cuda\\cuda_call.cc:121 onnxruntime::CudaCall D:\\a\\_work\\1\\s\\onnxruntime\\core\\providers\\cuda\\cuda_call.cc:114 onnxruntime::CudaCall CUBLAS failure 3: CUBLAS_STATUS_ALLOC_FAILED ; GPU=0 ; hostname=LAPTOP-LNF9BQ81 ; file=D:\\a\\_work\\1\\s\\onnxruntime\\core\\providers\\cuda\\cuda_stream_handle.cc ; line=73 ; expr=cublasCreate(&cublas_handle_);";
    assert_eq!(kind(FAIL, cublas), ErrorKind::Oom);
}

/// microsoft/onnxruntime#15715: a Stable Diffusion VAE decoder at batch 32 (31 works). The
/// same job in smaller pieces runs, so it goes down the degrade ladder like an OOM.
#[test]
fn cudnn_refusing_a_too_large_tensor_is_degraded_like_oom() {
    let text = "Non-zero status code returned while running Conv node. Name:'/decoder/up_blocks.2/upsamplers.0/conv/Conv' Status Message: CUDNN failure 9: CUDNN_STATUS_NOT_SUPPORTED ; GPU=0 ; hostname=images-generation-triton-backend-test-c5f9949d-cgxz2 ; expr=cudnnSetTensorNdDescriptor(tensor_, dataType, static_cast<int>(rank), dims.data(), strides.data());";
    assert_eq!(kind(FAIL, text), ErrorKind::Oom);
}

#[test]
fn driver_faults() {
    let cases = [
        // microsoft/onnxruntime#5295 (ORT 1.4 log line, CUDA 11).
        "[E:onnxruntime:test, cuda_call.cc:119 CudaCall] CUDA failure 700: an illegal memory access was encountered ; GPU=0 ; hostname=hemantj-X299-A ; expr=cudaMemcpy(dst_data, src_data, bytes, cudaMemcpyHostToDevice);",
        // microsoft/onnxruntime#1591 (CUDA 10.0 numbered it 77).
        "/home/hummingbird/onnxruntime/onnxruntime/core/providers/cuda/cuda_call.cc:91 bool onnxruntime::CudaCall(ERRTYPE, const char*, const char*, ERRTYPE, const char*) [with ERRTYPE = cudaError; bool THRW = true] CUDA failure 77: an illegal memory access was encountered ; GPU=0 ; hostname=supun-k80 ; expr=cudaEventDestroy(read_event_);",
        // Project-MONAI/MONAI#6867 (the runtime's error name with its string).
        "RuntimeError: transform: failed to synchronize: cudaErrorIllegalAddress: an illegal memory access was encountered",
        // C0untFloyd/roop-unleashed#32 (ORT CUDA EP; the driver reset the display meanwhile).
        "[ONNXRuntimeError] : 1 : FAIL : CUDA failure 719: unspecified launch failure ; GPU=0 ; hostname=BALYN-OMAVEL ; file=D:\\a\\_work\\1\\s\\onnxruntime\\core\\providers\\cuda\\gpu_data_transfer.cc ; line=73 ; expr=cudaMemcpyAsync(dst_data, src_data, bytes, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream.GetHandle()));",
        // microsoft/onnxruntime#14211 (ORT CUDA EP at session creation).
        "/onnxruntime_src/onnxruntime/core/providers/cuda/cuda_call.cc:116 bool onnxruntime::CudaCall(ERRTYPE, const char*, const char*, ERRTYPE, const char*) [with ERRTYPE = cudaError; bool THRW = true] CUDA failure 999: unknown error ; GPU=192915439 ; expr=cudaSetDevice(info_.device_id);",
        // vllm-project/vllm#5222 (PyTorch's rendering of cudaErrorECCUncorrectable).
        "RuntimeError: CUDA error: uncorrectable ECC error encountered",
        // nagadit/DeepFaceLab_Linux#89 (driver API name).
        "failed call to cuDevicePrimaryCtxRetain: CUDA_ERROR_ECC_UNCORRECTABLE: uncorrectable ECC error encountered",
        // pop-os/pop#3363: the kernel log line for XID 79 (what a log watcher would feed in).
        "NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.",
        // NVIDIA/NVSentinel#155: the same without an XID.
        "NVRM: (PCI ID: 10de:26b5) installed in this system has\n               NVRM: fallen off the bus and is not responding to commands.",
        // C0untFloyd/roop-unleashed#995 (ORT CUDA EP, Gemm).
        "Non-zero status code returned while running Gemm node. Name:'Gemm_568' Status Message: CUBLAS failure 13: CUBLAS_STATUS_EXECUTION_FAILED ; GPU=0 ; hostname=LED-PC ; file=D:\\a\\_work\\1\\s\\onnxruntime\\core\\providers\\cuda\\math\\gemm.cc ; line=121 ; expr=cublasGemmHelper( GetCublasHandle(ctx), CUBLAS_OP_N, CUBLAS_OP_N, N, M, 1, &one, b_data, N, GetConstOnes<CudaT>(M, Stream(ctx)), 1, &zero, out_data, N, device_prop);",
        // microsoft/onnxruntime#26221 (ORT 1.23 on an RTX 5090: the build lacks the card's
        // kernels; every job would fail here, none is at fault).
        "Non-zero status code returned while running Relu node. Name:'Relu_2' Status Message: CUDA error cudaErrorNoKernelImageForDevice:no kernel image is available for execution on the device",
        // microsoft/onnxruntime#2386 (cuBLAS cannot start: driver/library mismatch).
        "[with ERRTYPE = cublasStatus_t; bool THRW = true] CUBLAS failure 1: CUBLAS_STATUS_NOT_INITIALIZED ; GPU=0 ; hostname=atlas-FIAI ; expr=cublasCreate(&cublas_handle_);",
    ];
    for text in cases {
        assert_eq!(kind(FAIL, text), ErrorKind::DriverFault, "{text}");
    }
}

#[test]
fn termination_is_a_timeout() {
    // ONNX Runtime's text for a run stopped by `RunOptions::terminate` (in libonnxruntime
    // 1.31.1; also the `ort` crate's doc for `RunOptions::terminate`).
    assert_eq!(kind(FAIL, "Exiting due to terminate flag being set to true."), ErrorKind::Timeout);
    assert_eq!(classify_render(&RenderError::Terminated { stage: Stage::Unet }), ErrorKind::Timeout);
}

#[test]
fn refused_inputs_and_requests_are_invalid() {
    // ONNX Runtime's input shape check, as a fixed-size export refuses another size; code 2
    // INVALID_ARGUMENT. Assembled from libonnxruntime 1.31.1's format strings ("Got invalid
    // dimensions for ", " for the following indices", " Please fix either the inputs/outputs
    // or the model.") with an input name and sizes of ours.
    let text = "Got invalid dimensions for input: sample for the following indices\n index: 2 Got: 96 Expected: 128\n Please fix either the inputs/outputs or the model.";
    assert_eq!(kind(Some(2), text), ErrorKind::Invalid);
    assert_eq!(classify_render(&RenderError::InvalidRequest("size 60x64 is not a positive multiple of 8".into())), ErrorKind::Invalid);
    assert_eq!(classify_render(&RenderError::Tokenize("bad prompt".into())), ErrorKind::Invalid);
}

#[test]
fn other_render_errors_are_transient() {
    assert_eq!(classify_render(&RenderError::Cancelled { steps_done: 3 }), ErrorKind::Transient);
    assert_eq!(classify_render(&RenderError::Output { stage: Stage::Vae, detail: "shape".into() }), ErrorKind::Transient);
    // An ONNX Runtime error without a recognised text.
    let source = ort::Error::new_with_code(ort::error::ErrorCode::GenericFailure, "something new went wrong");
    assert_eq!(classify_render(&RenderError::Runtime { stage: Stage::Unet, source }), ErrorKind::Transient);
    let source = ort::Error::new_with_code(ort::error::ErrorCode::RuntimeException, "CUDA failure 2: out of memory ; GPU=0");
    assert_eq!(classify_render(&RenderError::Runtime { stage: Stage::Unet, source }), ErrorKind::Oom);
}

#[test]
fn nvml_errors() {
    for err in [NvmlError::GpuLost, NvmlError::ResetRequired, NvmlError::Unknown, NvmlError::DriverNotLoaded, NvmlError::LibRmVersionMismatch] {
        assert_eq!(classify_nvml(&err), ErrorKind::DriverFault, "{err:?}");
    }
    for err in [NvmlError::Timeout, NvmlError::NotSupported, NvmlError::NoPermission, NvmlError::InvalidArg, NvmlError::Uninitialized] {
        assert_eq!(classify_nvml(&err), ErrorKind::Transient, "{err:?}");
    }
}

#[test]
fn exit_codes_are_distinct_and_not_signals() {
    let codes = [EXIT_CONFIG, EXIT_START, EXIT_DRIVER_FAULT, EXIT_RESTART, EXIT_STORE, EXIT_NOTHING_FITS];
    for (i, a) in codes.iter().enumerate() {
        assert!(*a < 128, "{a} reads as a signal");
        assert!(codes[i + 1..].iter().all(|b| a != b));
    }
    // What the README and the systemd unit promise.
    assert_eq!(codes, [2, 3, 75, 76, 77, 78]);
}
