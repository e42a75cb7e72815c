package main

import "slices"

// Spellings live in tables: every name, C++ type and C++ enumerator the generator prints comes
// from here, so templates never spell a type by hand and the YAML, the file names, the dispatch
// table and the manifest agree on one vocabulary. The tables own that vocabulary for the whole
// repository: the dtypes (with their torch names), the algorithms, the output kinds, the scale
// rules, the kernel limits and the device API version. Besides out/, the generator emits them
// into two checked-in files (vocab.go; the Python package and the C++ build without Go): the
// C++ header csrc/arfuse/vocab.h (the enums with their names, the limits, the API version; the
// hand-written C++ includes it through csrc/arfuse/params.h) and the Python module
// arfuse/_vocab_tables.py (the rows arfuse/_vocab.py builds its names from). gen --check fails
// while either is not what these tables say. What stays hand-written against them is checked by
// go test ./gen (tables_test.go): the output kinds' device writers (csrc/arfuse/writers.cuh).

// apiVersion is ARFUSE_DEVICE_API_VERSION (csrc/arfuse/vocab.h) and arfuse._lib.API_VERSION
// (arfuse/_vocab_tables.py). Bump it whenever LaunchParams (csrc/arfuse/params.h), the kernel
// template's parameters, the launcher signature or the dispatch table's Instance
// (csrc/arfuse/dispatch.h) change. Every file of out/ static_asserts on it, so stale generated
// output stops compiling, and the Python package refuses a library whose manifest names another.
const apiVersion = 13

// ---- kernel limits ----------------------------------------------------------------------------

// vectorBytes is the width of one vectorised global-memory access.
const vectorBytes = 16

// maxHidden is the largest hidden size the matrix accepts for a specialised instance.
const maxHidden = 65536

// Generic-instance limits (the device code relies on them): up to genericMaxThreads threads per
// token (kernel.cuh: kBlockThreads and kWarpsPerToken of a generic KernelConfig), each holding at
// most maxVecsPerThread 16-byte vectors of the row in registers (kernel.cuh: the kVpt
// static_assert, which holds for specialised plans too).
const (
	genericMaxThreads = 512
	maxVecsPerThread  = 8
	// twoShotMaxThreads bounds the threads of one token's CTA in a specialised two-shot plan.
	twoShotMaxThreads = 512
)

// clusterSizes are the thread-block cluster sizes a one-shot row may be split over, largest
// first (the plan takes the first that fits); kernel.cuh's static_assert accepts these and 1.
var clusterSizes = []int{8, 4, 2}

// maxWorld is the largest tensor-parallel group a communicator serves: arfuse::kMaxWorld.
const maxWorld = 16

// maxTopK is the most experts per token a model may route to: arfuse::kMaxTopK.
const maxTopK = 64

// quantGroup is the elements per group of the fp8_group128 output: arfuse::kQuantGroup.
const quantGroup = 128

// Limit is one kernel limit as the other languages spell it.
type Limit struct {
	Py    string // its key in arfuse/_vocab.py LIMITS
	C     string // its constexpr int in namespace arfuse (csrc/arfuse/vocab.h)
	Value int
	Doc   string // the C++ comment
}

// limits are the kernel limits the Python package and the C++ code read, in the order printed.
var limits = []Limit{
	{"vector_bytes", "kVectorBytes", vectorBytes, "bytes of one vectorised global-memory access"},
	{"max_hidden", "kMaxHidden", maxHidden, "largest hidden size of a specialised instance"},
	{"generic_max_threads", "kGenericMaxThreads", genericMaxThreads, "most threads per token (and per block) of a generic instance"},
	{"max_vecs_per_thread", "kMaxVecsPerThread", maxVecsPerThread, "most 16-byte vectors of the row one thread holds in registers"},
	{"max_world", "kMaxWorld", maxWorld, "largest tensor-parallel group a communicator serves"},
	{"max_top_k", "kMaxTopK", maxTopK, "largest K (experts per token) accepted by the op"},
	{"quant_group", "kQuantGroup", quantGroup, "elements per group of OutKind::kFP8Group128 (its writer's kGroup)"},
}

// ---- dtypes, algorithms, output kinds ---------------------------------------------------------
// Each table's order is the order of its C++ enum (csrc/arfuse/vocab.h, printed from the table):
// an entry's position is its enumerator's value, which is also what the torch ops take and return
// for it.

// DType is one activation dtype.
type DType struct {
	Name  string // short name used in YAML and variant names
	Torch string // torch dtype (torch.bfloat16), the ScalarType the ops take
	CType string // C++ element type
	Enum  string // C++ enumerator
	Size  int    // bytes per element
}

// Vec is the number of elements in one 16-byte vector.
func (d *DType) Vec() int { return vectorBytes / d.Size }

var dtypes = []*DType{
	{Name: "bf16", Torch: "bfloat16", CType: "__nv_bfloat16", Enum: "arfuse::DType::kBF16", Size: 2},
	{Name: "fp16", Torch: "float16", CType: "__half", Enum: "arfuse::DType::kFP16", Size: 2},
	{Name: "fp32", Torch: "float32", CType: "float", Enum: "arfuse::DType::kFP32", Size: 4},
}

// Algo is one algorithm of the fused op: an all-reduce algorithm for world sizes 2 and up, or
// local, the world-size-1 op (finalize + shared add + residual + RMSNorm with no communication,
// no workspace and no waits: single-GPU serving).
type Algo struct {
	Name string
	Enum string
	// Local: the algorithm of world size 1 and of no other. The all-reduce algorithms serve world
	// sizes 2 and up only (worldRule in plan.go).
	Local bool
}

// algoAuto is arfuse::Algo::kAuto (value 0): resolved on the host (local at world size 1, else
// one-shot or two-shot by the tuned threshold), so it is never instantiated and not in algos, the
// algorithms a kernel instance is built for (values 1, 2, ...).
var algoAuto = &Algo{Name: "auto", Enum: "arfuse::Algo::kAuto"}

var algos = []*Algo{
	{Name: "oneshot", Enum: "arfuse::Algo::kOneShot"},
	{Name: "twoshot", Enum: "arfuse::Algo::kTwoShot"},
	{Name: "local", Enum: "arfuse::Algo::kLocal", Local: true},
}

// allAlgos is the whole arfuse::Algo enum in value order.
func allAlgos() []*Algo { return append([]*Algo{algoAuto}, algos...) }

// OutKind is what the kernel writes after the RMSNorm: one row of traits, printed for each
// language that needs them. Adding a kind is this row, its device writer (csrc/arfuse/writers.cuh)
// and its reference quantizer (arfuse/reference.py); its enumerator (csrc/arfuse/vocab.h), its
// Python row (arfuse/_vocab_tables.py), the host table (out/out_kinds.cpp) and every loop over
// them follow (gen/README.md lists the files).
type OutKind struct {
	Name string
	Enum string // arfuse::OutKind enumerator (csrc/arfuse/vocab.h)
	// Writer is the device writer struct of csrc/arfuse/writers.cuh the kernel instance is built
	// with (its kKind is Enum): the one place that writes this kind's norm_out and scales.
	Writer string
	// Torch is the torch dtype of norm_out ("" = the activation dtype) and Scalar its
	// torch::headeronly::ScalarType enumerator.
	Torch, Scalar string
	// Scales is how the scale arrives or is written (see scaleRules).
	Scales *ScaleRule
	// Group is the elements per quantization group whose scale the kernel reduces over a few
	// lanes of one warp (0: none). A specialised plan must keep every group within one CTA's
	// slice of the row and within one warp (see groupPlanRule).
	Group int
	// Bounded: the op takes scale_ub, an upper bound of amax. Layouts: it takes
	// col_major_scales and ue8m0 (the scale layout and power-of-two scales).
	Bounded, Layouts bool
}

// ScaleRule is how an output kind's scales arrive or are written; it decides the scales tensor
// the host allocates and the op that serves the kind (fused takes an input scale, fused_fp8_dynamic
// writes one per token or per group and picks the kind by group_size).
type ScaleRule struct {
	Name string // the arfuse/_vocab.py spelling
	Enum string // arfuse::host::Scales enumerator (csrc/arfuse/vocab.h)
}

var (
	scaleNone  = &ScaleRule{Name: "none", Enum: "arfuse::host::Scales::kNone"}
	scaleInput = &ScaleRule{Name: "input", Enum: "arfuse::host::Scales::kInput"}    // one float32 input (fp8_scale)
	scaleToken = &ScaleRule{Name: "token", Enum: "arfuse::host::Scales::kPerToken"} // written, float32 [T]
	scaleGroup = &ScaleRule{Name: "group", Enum: "arfuse::host::Scales::kPerGroup"} // written, float32 [T, H / Group]
)

// scaleRules is the arfuse::host::Scales enum in value order.
var scaleRules = []*ScaleRule{scaleNone, scaleInput, scaleToken, scaleGroup}

const fp8Torch, fp8Scalar = "float8_e4m3fn", "Float8_e4m3fn"

var outKinds = []*OutKind{
	{Name: "norm", Enum: "arfuse::OutKind::kNorm", Writer: "arfuse::NormWriter", Scales: scaleNone},
	{Name: "fp8_static", Enum: "arfuse::OutKind::kFP8Static", Writer: "arfuse::Fp8StaticWriter",
		Torch: fp8Torch, Scalar: fp8Scalar, Scales: scaleInput},
	{Name: "fp8_token", Enum: "arfuse::OutKind::kFP8Token", Writer: "arfuse::Fp8TokenWriter",
		Torch: fp8Torch, Scalar: fp8Scalar, Scales: scaleToken, Bounded: true},
	{Name: "fp8_group128", Enum: "arfuse::OutKind::kFP8Group128", Writer: "arfuse::Fp8Group128Writer",
		Torch: fp8Torch, Scalar: fp8Scalar, Scales: scaleGroup, Group: quantGroup, Layouts: true},
}

// worldSizes are the tensor-parallel group sizes a specialised instance may be built for (the
// generic instances of the all-reduce algorithms serve any size from 2 up to maxWorld; world
// size 1 is the local algorithm's, whose generic instance serves any hidden size at world size 1).
var worldSizes = []int{1, 2, 4, 8, 16}

// ---- torch ops --------------------------------------------------------------------------------

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
// CompositeExplicitAutograd. Nothing is registered here for tracing or for the CPU: the fake
// implementations (torch.library.register_fake in arfuse/_fake.py, so that torch.compile keeps
// the token count symbolic) and the CPU implementation of a world-size-1 communicator
// (arfuse/_cpu.py) are Python.
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
	{Name: "comm_set_pdl", Signature: "(int comm, bool enable) -> ()", Kernels: anywhere("comm_set_pdl")},
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
	{Name: "instance_for", Signature: "(ScalarType dtype, int hidden, int world_size, int algorithm, int out_kind, int num_tokens=-1) -> str", Kernels: anywhere("instance_for")},
	{Name: "oneshot_threshold", Signature: "(ScalarType dtype, int hidden, int world_size, str card=\"\") -> int", Kernels: anywhere("oneshot_threshold")},
}

// byName returns the entry of table called name, or nil.
func byName[T interface{ name() string }](table []T, name string) T {
	for _, e := range table {
		if e.name() == name {
			return e
		}
	}
	var none T
	return none
}

// namesOf lists the names of a table's entries in table order.
func namesOf[T interface{ name() string }](table []T) []string {
	var s []string
	for _, e := range table {
		s = append(s, e.name())
	}
	return s
}

func (d *DType) name() string   { return d.Name }
func (a *Algo) name() string    { return a.Name }
func (o *OutKind) name() string { return o.Name }

func dtypeByName(name string) *DType     { return byName(dtypes, name) }
func algoByName(name string) *Algo       { return byName(algos, name) }
func outKindByName(name string) *OutKind { return byName(outKinds, name) }

func dtypeNames() []string { return namesOf(dtypes) }

func dtypeIndex(d *DType) int { return slices.Index(dtypes, d) }
