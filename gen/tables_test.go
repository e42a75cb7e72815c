package main

import (
	"bytes"
	"encoding/json"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// The tables own the vocabulary; these tests compare every copy of it with them: the C++ enums
// and limits in csrc/arfuse/params.h, the literals of csrc/arfuse/kernel.cuh, csrc/dispatch.cpp
// and csrc/kernels.cu, and the Python module arfuse/_vocab.py.

func readRepoFile(t *testing.T, rel string) []byte {
	t.Helper()
	data, err := os.ReadFile("../" + rel)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// cppEnum returns the enumerators of `enum class name : int32_t { ... }` in order, each checked
// to have the value of its position.
func cppEnum(t *testing.T, src []byte, name string) []string {
	t.Helper()
	m := regexp.MustCompile(`enum class ` + name + ` : int32_t \{([^}]*)\}`).FindSubmatch(src)
	if m == nil {
		t.Fatalf("params.h has no enum class %s", name)
	}
	var names []string
	for i, e := range strings.Split(string(m[1]), ",") {
		kv := strings.Split(e, "=")
		if len(kv) != 2 || strings.TrimSpace(kv[1]) != strconv.Itoa(i) {
			t.Fatalf("params.h %s: enumerator %q is not `kName = %d`", name, strings.TrimSpace(e), i)
		}
		names = append(names, name+"::"+strings.TrimSpace(kv[0]))
	}
	return names
}

func enumsOf[T any](table []T, enum func(T) string) []string {
	var s []string
	for _, e := range table {
		s = append(s, strings.TrimPrefix(enum(e), "arfuse::"))
	}
	return s
}

// cppConst returns the value of `constexpr int name = N;`.
func cppConst(t *testing.T, src []byte, file, name string) int {
	t.Helper()
	m := regexp.MustCompile(`constexpr int ` + name + ` = (\d+);`).FindSubmatch(src)
	if m == nil {
		t.Fatalf("%s has no constexpr int %s", file, name)
	}
	v, _ := strconv.Atoi(string(m[1]))
	return v
}

// The C++ enums are the tables, in order, and nothing else; the spellings the generator prints
// exist in the hand-written headers the output compiles against.
func TestTablesMatchHeaders(t *testing.T) {
	params := readRepoFile(t, "csrc/arfuse/params.h")
	opsH := readRepoFile(t, "csrc/arfuse/ops.h")
	if got, want := cppEnum(t, params, "DType"), enumsOf(dtypes, func(d *DType) string { return d.Enum }); !slices.Equal(got, want) {
		t.Errorf("params.h DType is %v, the dtype table %v", got, want)
	}
	if got, want := cppEnum(t, params, "Algo"), enumsOf(allAlgos(), func(a *Algo) string { return a.Enum }); !slices.Equal(got, want) {
		t.Errorf("params.h Algo is %v, the algorithm table (auto first) %v", got, want)
	}
	if got, want := cppEnum(t, params, "OutKind"), enumsOf(outKinds, func(o *OutKind) string { return o.Enum }); !slices.Equal(got, want) {
		t.Errorf("params.h OutKind is %v, the output kind table %v", got, want)
	}
	outKindsH := readRepoFile(t, "csrc/host/out_kinds.h")
	if got, want := cppEnum(t, outKindsH, "Scales"), enumsOf(scaleRules, func(r *ScaleRule) string { return strings.TrimPrefix(r.Enum, "arfuse::host::") }); !slices.Equal(got, want) {
		t.Errorf("csrc/host/out_kinds.h Scales is %v, the scale rule table %v", got, want)
	}
	for name, want := range map[string]int{"kQuantGroup": quantGroup, "kMaxWorld": maxWorld, "kMaxTopK": maxTopK} {
		if got := cppConst(t, params, "params.h", name); got != want {
			t.Errorf("params.h %s = %d, the tables %d", name, got, want)
		}
	}
	if slices.Max(worldSizes) > maxWorld {
		t.Errorf("worldSizes %v go beyond maxWorld %d", worldSizes, maxWorld)
	}
	declared := func(fn string) bool {
		return regexp.MustCompile(`\b` + fn + `\(`).Match(opsH)
	}
	for _, op := range ops {
		if !strings.HasPrefix(op.Signature, "(") || !strings.Contains(op.Signature, ") -> ") {
			t.Errorf("%s: odd signature %q", op.Name, op.Signature)
		}
		if len(op.Kernels) == 0 {
			t.Errorf("%s: no kernel for any dispatch key", op.Name)
		}
		for _, k := range op.Kernels {
			if !slices.Contains(dispatchKeys, k.Key) {
				t.Errorf("%s: unknown dispatch key %s", op.Name, k.Key)
			}
			if k.Fn != "" && !declared(k.Fn) {
				t.Errorf("%s: %s::%s is not declared in csrc/arfuse/ops.h", op.Name, opsNamespace, k.Fn)
			}
		}
	}
}

// Every output kind is one row: its device writer is a struct of csrc/arfuse/writers.cuh whose
// kKind is the row's enumerator and whose kGroup is the row's group; a kind with scales written per
// group has a group, the others none; and only a kind that writes its scales takes scale_ub or the
// scale layouts.
func TestOutKindRows(t *testing.T) {
	writers := string(readRepoFile(t, "csrc/arfuse/writers.cuh"))
	for _, o := range outKinds {
		name := strings.TrimPrefix(o.Writer, "arfuse::")
		m := regexp.MustCompile(`(?s)\nstruct ` + regexp.QuoteMeta(name) + ` \{\n  static constexpr OutKind kKind = (\S+);\n  static constexpr int kGroup = (\S+);`).FindStringSubmatch(writers)
		if m == nil {
			t.Errorf("%s: csrc/arfuse/writers.cuh has no struct %s starting with kKind and kGroup", o.Name, name)
			continue
		}
		if got := "arfuse::" + m[1]; got != o.Enum {
			t.Errorf("%s: %s::kKind is %s, the table says %s", o.Name, name, got, o.Enum)
		}
		group := map[string]int{"0": 0, "kQuantGroup": quantGroup}[m[2]]
		if group != o.Group || (group == 0 && m[2] != "0") {
			t.Errorf("%s: %s::kGroup is %s, the table says %d", o.Name, name, m[2], o.Group)
		}
		if (o.Scales == scaleGroup) != (o.Group != 0) {
			t.Errorf("%s: scales %s with group %d (a group is what per-group scales need)", o.Name, o.Scales.Name, o.Group)
		}
		written := o.Scales == scaleToken || o.Scales == scaleGroup
		if (o.Bounded || o.Layouts) && !written {
			t.Errorf("%s: scale_ub and the scale layouts are for kinds that write their scales", o.Name)
		}
		if (o.Torch == "") != (o.Scalar == "") {
			t.Errorf("%s: torch dtype %q and ScalarType %q go together", o.Name, o.Torch, o.Scalar)
		}
	}
	// One kind per way of being asked for: fused takes no scale or an input scale,
	// fused_fp8_dynamic a group_size.
	seen := map[string]string{}
	for _, o := range outKinds {
		key := o.Scales.Name
		if o.Scales == scaleToken || o.Scales == scaleGroup {
			key = "dynamic group_size " + strconv.Itoa(o.Group)
		}
		if prev, dup := seen[key]; dup {
			t.Errorf("%s and %s are both asked for as %s", prev, o.Name, key)
		}
		seen[key] = o.Name
	}
}

// The kernel limits the plan relies on are literals in the hand-written CUDA; each must be the
// tables' value.
func TestKernelLimitsMatchCUDA(t *testing.T) {
	kernel := readRepoFile(t, "csrc/arfuse/kernel.cuh")
	clusters := "kCluster == 1"
	for _, c := range slices.Sorted(slices.Values(clusterSizes)) {
		clusters += " || kCluster == " + strconv.Itoa(c)
	}
	for _, c := range []struct{ file, literal, what string }{
		{"kernel.cuh", "kBlockThreads = kGeneric ? " + strconv.Itoa(genericMaxThreads) + " :", "generic block: genericMaxThreads"},
		{"kernel.cuh", "kWarpsPerToken = kGeneric ? " + strconv.Itoa(genericMaxThreads/32) + " :", "generic warps per token: genericMaxThreads / 32"},
		{"kernel.cuh", "kVpt >= 1 && kVpt <= " + strconv.Itoa(maxVecsPerThread) + ",", "vectors per thread: maxVecsPerThread"},
		{"kernel.cuh", clusters + ",", "cluster sizes: 1 and clusterSizes"},
	} {
		if !bytes.Contains(kernel, []byte(c.literal)) {
			t.Errorf("csrc/arfuse/%s: no %q (%s)", c.file, c.literal, c.what)
		}
	}
	// The vector width of each dtype, as the host code spells it: fp32 is the one 4-byte dtype.
	for _, d := range dtypes {
		if (d.Name == "fp32") != (d.Vec() == 4) || (d.Name != "fp32" && d.Vec() != 8) {
			t.Errorf("%s: vector of %d elements; csrc/dispatch.cpp and csrc/kernels.cu say fp32 ? 4 : 8", d.Name, d.Vec())
		}
	}
	for file, literal := range map[string]string{
		"csrc/dispatch.cpp": "return dtype == DType::kFP32 ? 4 : 8;",
		"csrc/kernels.cu":   "const int vec = dtype == DType::kFP32 ? 4 : 8;",
	} {
		if !bytes.Contains(readRepoFile(t, file), []byte(literal)) {
			t.Errorf("%s: no %q (the dtype table's vector widths)", file, literal)
		}
	}
}

// pyOutput is one output kind row of arfuse/_vocab.py.
type pyOutput struct {
	Name    string `json:"name"`
	Torch   string `json:"torch"`
	Scales  string `json:"scales"`
	Group   int    `json:"group"`
	Bounded bool   `json:"bounded"`
	Layouts bool   `json:"layouts"`
}

// pyVocab is the JSON block of arfuse/_vocab.py.
type pyVocab struct {
	DTypes []struct {
		Name  string `json:"name"`
		Torch string `json:"torch"`
		Bytes int    `json:"bytes"`
	} `json:"dtypes"`
	Algorithms      []string       `json:"algorithms"`
	LocalAlgorithms []string       `json:"local_algorithms"`
	Outputs         []pyOutput     `json:"outputs"`
	Limits          map[string]int `json:"limits"`
}

// arfuse/_vocab.py holds the tables as JSON; it must be exactly what the Go tables say.
func TestPythonVocabulary(t *testing.T) {
	src := readRepoFile(t, "arfuse/_vocab.py")
	m := regexp.MustCompile(`(?s)\n_TABLES = json\.loads\("""(.*?)"""\)`).FindSubmatch(src)
	if m == nil {
		t.Fatal(`arfuse/_vocab.py has no _TABLES = json.loads("""...""")`)
	}
	dec := json.NewDecoder(bytes.NewReader(m[1]))
	dec.DisallowUnknownFields()
	var got pyVocab
	if err := dec.Decode(&got); err != nil {
		t.Fatalf("arfuse/_vocab.py _TABLES: %v", err)
	}
	var want pyVocab
	for _, d := range dtypes {
		want.DTypes = append(want.DTypes, struct {
			Name  string `json:"name"`
			Torch string `json:"torch"`
			Bytes int    `json:"bytes"`
		}{d.Name, d.Torch, d.Size})
	}
	want.Algorithms = namesOf(allAlgos())
	for _, a := range algos {
		if a.Local {
			want.LocalAlgorithms = append(want.LocalAlgorithms, a.Name)
		}
	}
	for _, o := range outKinds {
		want.Outputs = append(want.Outputs, pyOutput{o.Name, o.Torch, o.Scales.Name, o.Group, o.Bounded, o.Layouts})
	}
	want.Limits = map[string]int{
		"vector_bytes": vectorBytes, "max_hidden": maxHidden, "generic_max_threads": genericMaxThreads,
		"max_vecs_per_thread": maxVecsPerThread, "max_world": maxWorld, "max_top_k": maxTopK,
		"quant_group": quantGroup,
	}
	if !reflect.DeepEqual(got, want) {
		g, _ := json.Marshal(got)
		w, _ := json.Marshal(want)
		t.Errorf("arfuse/_vocab.py _TABLES is not gen/tables.go:\n got %s\nwant %s", g, w)
	}
}

// The registration template prints each schema with %q (a quote in a default value, such as
// oneshot_threshold's card="", must be escaped in the C++ literal). %q's escapes are C++ escapes
// only for printable ASCII: a \xNN would swallow the hex digits after it in C++.
func TestOpSignaturesArePrintableASCII(t *testing.T) {
	for _, op := range ops {
		for _, c := range op.Name + op.Signature {
			if c < 0x20 || c > 0x7e {
				t.Errorf("op %s: schema character %q is not printable ASCII", op.Name, c)
			}
		}
	}
}
