package main

// Spellings live in tables: every name, C++ type and C++ enumerator the generator prints comes
// from here, so templates never spell a type by hand and the YAML, the file names, the dispatch
// table and the manifest agree on one vocabulary.

// apiVersion must equal ARFUSE_DEVICE_API_VERSION in csrc/arfuse/params.h (checked by a test).
// Every generated C++ file static_asserts on it so that stale output stops compiling.
const apiVersion = 9

// vectorBytes is the width of one vectorised global-memory access.
const vectorBytes = 16

// maxHidden is the largest hidden size the matrix accepts for a specialised instance.
const maxHidden = 65536

// Generic-instance limits (the device code relies on them): up to 512 threads per token, each
// holding at most maxVecsPerThread 16-byte vectors of the row in registers.
const (
	genericMaxThreads = 512
	maxVecsPerThread  = 8
	// twoShotMaxThreads bounds the threads of one token's CTA in a specialised two-shot plan.
	twoShotMaxThreads = 512
)

// DType is one activation dtype. Index is the value of the arfuse::DType enumerator: the order of
// this table is the order of the enum in csrc/arfuse/params.h.
type DType struct {
	Name  string // short name used in YAML and variant names
	CType string // C++ element type
	Enum  string // C++ enumerator
	Size  int    // bytes per element
}

// Vec is the number of elements in one 16-byte vector.
func (d *DType) Vec() int { return vectorBytes / d.Size }

var dtypes = []*DType{
	{Name: "bf16", CType: "__nv_bfloat16", Enum: "arfuse::DType::kBF16", Size: 2},
	{Name: "fp16", CType: "__half", Enum: "arfuse::DType::kFP16", Size: 2},
	{Name: "fp32", CType: "float", Enum: "arfuse::DType::kFP32", Size: 4},
}

// Algo is one all-reduce algorithm. arfuse::Algo::kAuto is resolved on the host and is never
// instantiated, so it is not in the table.
type Algo struct {
	Name string
	Enum string
}

var algos = []*Algo{
	{Name: "oneshot", Enum: "arfuse::Algo::kOneShot"},
	{Name: "twoshot", Enum: "arfuse::Algo::kTwoShot"},
}

// OutKind is what the kernel writes after the RMSNorm. Index is the value of the
// arfuse::OutKind enumerator (csrc/arfuse/params.h).
type OutKind struct {
	Name string
	Enum string
	// Group is the elements per quantization group whose scale the kernel reduces over a few
	// lanes of one warp (0: none). A specialised plan must keep every group within one CTA's
	// slice of the row and within one warp (see groupRule).
	Group int
}

// quantGroup mirrors arfuse::kQuantGroup in csrc/arfuse/params.h.
const quantGroup = 128

var outKinds = []*OutKind{
	{Name: "norm", Enum: "arfuse::OutKind::kNorm"},
	{Name: "fp8_static", Enum: "arfuse::OutKind::kFP8Static"},
	{Name: "fp8_token", Enum: "arfuse::OutKind::kFP8Token"},
	{Name: "fp8_group128", Enum: "arfuse::OutKind::kFP8Group128", Group: quantGroup},
}

// maxTopK is the most experts per token a model may route to: arfuse::kMaxTopK in
// csrc/arfuse/params.h.
const maxTopK = 64

// worldSizes are the tensor-parallel group sizes a specialised instance may be built for
// (arfuse::kMaxWorld is 16).
var worldSizes = []int{2, 4, 8, 16}

// Op is one torch operator: its schema and the arfuse::ops functions that implement it, one per
// dispatch key. Registered on the PyTorch stable ABI: the schema with m.def() in
// STABLE_TORCH_LIBRARY, each kernel with m.impl(name, TORCH_BOX(&fn)) in the
// STABLE_TORCH_LIBRARY_IMPL block of its key.
type Op struct {
	Name      string
	Signature string     // the schema without the name: "(int comm) -> int"
	Kernels   []OpKernel // in the order of dispatchKeys
}

// OpKernel binds an op to one implementation function for one dispatch key.
type OpKernel struct {
	Key string
	Fn  string
}

// dispatchKeys is the order of the STABLE_TORCH_LIBRARY_IMPL blocks. The stable ABI has no
// catch-all registration (the CatchAll key fails to parse at load): ops that must run whatever
// their inputs (tensor-less ones, the validation the CPU implementation calls) are registered on
// CompositeExplicitAutograd. Fake (Meta) and CPU implementations of the fused ops are registered
// from Python (arfuse/_fake.py, arfuse/_cpu.py) with torch.library, so that torch.compile keeps
// the token count symbolic.
var dispatchKeys = []string{compositeKey, "CUDA"}

const compositeKey = "CompositeExplicitAutograd"

// opsNamespace is where the implementation functions live (csrc/arfuse/ops.h).
const opsNamespace = "arfuse::ops"

// anywhere is an op's one kernel on compositeKey.
func anywhere(fn string) []OpKernel { return []OpKernel{{Key: compositeKey, Fn: fn}} }

// cuda is an op's one kernel on the CUDA key.
func cuda(fn string) []OpKernel { return []OpKernel{{Key: "CUDA", Fn: fn}} }

// validateReturns is what the validation ops return: what they inferred from the arguments
// (csrc/arfuse/ops.h; arfuse/_cpu.py reads it).
const validateReturns = " -> int[]"

var ops = []Op{
	{Name: "comm_create", Signature: "(int rank, int world_size, int hidden, ScalarType dtype, int max_tokens, int oneshot_max_tokens, int ranks_per_device, Device device, float timeout_s) -> int", Kernels: anywhere("comm_create")},
	{Name: "comm_ipc_handle", Signature: "(int comm) -> Tensor", Kernels: anywhere("comm_ipc_handle")},
	{Name: "comm_open_peers", Signature: "(int comm, Tensor handles) -> ()", Kernels: anywhere("comm_open_peers")},
	{Name: "comm_set_local_peers", Signature: "(int comm, int[] comms) -> ()", Kernels: anywhere("comm_set_local_peers")},
	{Name: "comm_destroy", Signature: "(int comm) -> ()", Kernels: anywhere("comm_destroy")},
	{Name: "comm_status", Signature: "(int comm) -> int", Kernels: anywhere("comm_status")},
	{Name: "comm_info", Signature: "(int comm) -> int[]", Kernels: anywhere("comm_info")},
	{Name: "fused", Signature: "(Tensor expert_out, Tensor? permuted_idx, Tensor? expert_weights, Tensor? shared_out, Tensor? residual, Tensor gamma, float eps, float weight_bias, float routed_scaling, Tensor? fp8_scale, int comm, int algorithm) -> (Tensor, Tensor)",
		Kernels: cuda("fused")},
	{Name: "fused_inplace", Signature: "(Tensor(a!) input, Tensor(b!) residual, Tensor? shared_out, Tensor gamma, float eps, float weight_bias, float routed_scaling, int comm, int algorithm) -> ()",
		Kernels: cuda("fused_inplace")},
	{Name: "fused_fp8_dynamic", Signature: "(Tensor expert_out, Tensor? permuted_idx, Tensor? expert_weights, Tensor? shared_out, Tensor? residual, Tensor gamma, float eps, float weight_bias, float routed_scaling, int group_size, Tensor? scale_ub, bool col_major_scales, bool ue8m0, int comm, int algorithm) -> (Tensor, Tensor, Tensor)",
		Kernels: cuda("fused_fp8_dynamic")},
	{Name: "moe_finalize", Signature: "(Tensor expert_out, Tensor? permuted_idx, Tensor? expert_weights, Tensor? shared_out, float routed_scaling, int num_tokens) -> Tensor",
		Kernels: cuda("moe_finalize")},
	{Name: "validate", Signature: "(Tensor expert_out, Tensor? permuted_idx, Tensor? expert_weights, Tensor? shared_out, Tensor? residual, Tensor gamma, float eps, float weight_bias, Tensor? fp8_scale, int comm, int algorithm)" + validateReturns, Kernels: anywhere("validate_fused")},
	{Name: "validate_fp8_dynamic", Signature: "(Tensor expert_out, Tensor? permuted_idx, Tensor? expert_weights, Tensor? shared_out, Tensor? residual, Tensor gamma, float eps, float weight_bias, int group_size, Tensor? scale_ub, bool col_major_scales, bool ue8m0, int comm, int algorithm)" + validateReturns, Kernels: anywhere("validate_fp8_dynamic")},
	{Name: "validate_inplace", Signature: "(Tensor input, Tensor residual, Tensor? shared_out, Tensor gamma, float eps, float weight_bias, int comm, int algorithm)" + validateReturns, Kernels: anywhere("validate_inplace")},
	{Name: "validate_finalize", Signature: "(Tensor expert_out, Tensor? permuted_idx, Tensor? expert_weights, Tensor? shared_out, int num_tokens)" + validateReturns, Kernels: anywhere("validate_moe_finalize")},
	{Name: "defer_launches", Signature: "(bool enable) -> ()", Kernels: anywhere("defer_launches")},
	{Name: "flush_launches", Signature: "(bool launch) -> int", Kernels: anywhere("flush_launches")},
	{Name: "supported_variants", Signature: "() -> str[]", Kernels: anywhere("supported_variants")},
	{Name: "instance_for", Signature: "(ScalarType dtype, int hidden, int world_size, int algorithm, int out_kind) -> str", Kernels: anywhere("instance_for")},
	{Name: "oneshot_threshold", Signature: "(ScalarType dtype, int hidden, int world_size) -> int", Kernels: anywhere("oneshot_threshold")},
}

func dtypeByName(name string) *DType {
	for _, d := range dtypes {
		if d.Name == name {
			return d
		}
	}
	return nil
}

func algoByName(name string) *Algo {
	for _, a := range algos {
		if a.Name == name {
			return a
		}
	}
	return nil
}

func outKindByName(name string) *OutKind {
	for _, o := range outKinds {
		if o.Name == name {
			return o
		}
	}
	return nil
}

func dtypeNames() []string {
	var s []string
	for _, d := range dtypes {
		s = append(s, d.Name)
	}
	return s
}

func algoNames() []string {
	var s []string
	for _, a := range algos {
		s = append(s, a.Name)
	}
	return s
}

func outKindNames() []string {
	var s []string
	for _, o := range outKinds {
		s = append(s, o.Name)
	}
	return s
}

func dtypeIndex(d *DType) int {
	for i, x := range dtypes {
		if x == d {
			return i
		}
	}
	return -1
}
