package main

import (
	"bytes"
	"encoding/json"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// The tables own the vocabulary and the generator prints it into two checked-in files
// (csrc/arfuse/vocab.h, arfuse/_vocab_tables.py). These tests check that those files are current,
// that what the generator prints is what the tables say (read back the way C++ and Python read
// it), that no hand-written copy of it comes back, and what stays hand-written against the tables:
// the output kinds' device writers and the ops' implementation functions.

func readRepoFile(t *testing.T, rel string) []byte {
	t.Helper()
	data, err := os.ReadFile("../" + rel)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// renderedVocab renders the vocabulary files as the generator would write them.
func renderedVocab(t *testing.T) Files {
	t.Helper()
	v, err := newVocab()
	if err != nil {
		t.Fatal(err)
	}
	files, err := renderVocab(v)
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// The checked-in files are byte for byte what the generator writes (what gen --check and make
// check-generated enforce; here so that go test ./gen fails first, naming the file).
func TestVocabFilesAreCurrent(t *testing.T) {
	files := renderedVocab(t)
	if got := sortedPaths(files); !slices.Equal(got, []string{"arfuse/_vocab_tables.py", "csrc/arfuse/vocab.h"}) {
		t.Errorf("vocabulary files %v", got)
	}
	for _, rel := range sortedPaths(files) {
		data := files[rel]
		if !bytes.Contains(data[:min(len(data), 512)], []byte(generatedMarker)) {
			t.Errorf("%s: no generated header", rel)
		}
		if !bytes.Equal(readRepoFile(t, rel), data) {
			t.Errorf("%s is not what the generator writes from gen/tables.go: run make gen && build/bin/gen (or go run ./gen)", rel)
		}
	}
}

// cppEnum returns the enumerators of `enum class name : int32_t { ... }` in order, each checked
// to have the value of its position, and the namespace the enum is declared in (the last one
// opened before it: the header does not nest them).
func cppEnum(t *testing.T, src []byte, name string) (string, []string) {
	t.Helper()
	loc := regexp.MustCompile(`enum class ` + name + ` : int32_t \{([^}]*)\}`).FindSubmatchIndex(src)
	if loc == nil {
		t.Fatalf("vocab.h has no enum class %s", name)
	}
	opened := regexp.MustCompile(`(?m)^namespace (\S+) \{$`).FindAllSubmatch(src[:loc[0]], -1)
	if opened == nil {
		t.Fatalf("vocab.h: enum class %s is in no namespace", name)
	}
	var names []string
	for i, e := range strings.Split(string(src[loc[2]:loc[3]]), ",") {
		kv := strings.Split(e, "=")
		if len(kv) != 2 || strings.TrimSpace(kv[1]) != strconv.Itoa(i) {
			t.Fatalf("vocab.h %s: enumerator %q is not `kName = %d`", name, strings.TrimSpace(e), i)
		}
		names = append(names, name+"::"+strings.TrimSpace(kv[0]))
	}
	return string(opened[len(opened)-1][1]), names
}

// cppArray returns the initializers of `constexpr T name[] = {...};`.
func cppArray(t *testing.T, src []byte, typ, name string) []string {
	t.Helper()
	m := regexp.MustCompile(`constexpr ` + regexp.QuoteMeta(typ) + ` ` + name + `\[\] = \{([^}]*)\};`).FindSubmatch(src)
	if m == nil {
		t.Fatalf("vocab.h has no constexpr %s %s[]", typ, name)
	}
	var s []string
	for _, e := range strings.Split(string(m[1]), ",") {
		s = append(s, strings.TrimSpace(e))
	}
	return s
}

// cppConst returns the value of `constexpr int name = N;`.
func cppConst(t *testing.T, src []byte, name string) int {
	t.Helper()
	m := regexp.MustCompile(`constexpr int ` + name + ` = (\d+);`).FindSubmatch(src)
	if m == nil {
		t.Fatalf("vocab.h has no constexpr int %s", name)
	}
	v, _ := strconv.Atoi(string(m[1]))
	return v
}

// The generated header, read back: each enum is its table in value order in the table's
// namespace, with the table's names (and the dtypes' sizes); each limit and the API version are
// the tables' values.
func TestVocabHeader(t *testing.T) {
	h := renderedVocab(t)["csrc/arfuse/vocab.h"]
	quoted := func(names []string) []string {
		var q []string
		for _, n := range names {
			q = append(q, strconv.Quote(n))
		}
		return q
	}
	check := func(typ string, wantEnums, wantNames []string) {
		t.Helper()
		ns, got := cppEnum(t, h, typ)
		want := slices.Clone(wantEnums)
		for i, e := range want {
			want[i] = strings.TrimPrefix(e, ns+"::")
		}
		if !slices.Equal(got, want) {
			t.Errorf("vocab.h %s::%s is %v, the table %v", ns, typ, got, wantEnums)
		}
		if got := cppArray(t, h, "const char*", "k"+typ+"Names"); !slices.Equal(got, quoted(wantNames)) {
			t.Errorf("vocab.h k%sNames is %v, the table %v", typ, got, wantNames)
		}
	}
	enums := func(n int, enum func(int) string) []string {
		var s []string
		for i := range n {
			s = append(s, enum(i))
		}
		return s
	}
	check("DType", enums(len(dtypes), func(i int) string { return dtypes[i].Enum }), dtypeNames())
	check("Algo", enums(len(allAlgos()), func(i int) string { return allAlgos()[i].Enum }), namesOf(allAlgos()))
	check("OutKind", enums(len(outKinds), func(i int) string { return outKinds[i].Enum }), namesOf(outKinds))
	var scaleNames []string
	for _, r := range scaleRules {
		scaleNames = append(scaleNames, r.Name)
	}
	check("Scales", enums(len(scaleRules), func(i int) string { return scaleRules[i].Enum }), scaleNames)
	var sizes []string
	for _, d := range dtypes {
		sizes = append(sizes, strconv.Itoa(d.Size))
	}
	if got := cppArray(t, h, "int", "kDTypeBytes"); !slices.Equal(got, sizes) {
		t.Errorf("vocab.h kDTypeBytes is %v, the dtype table %v", got, sizes)
	}
	var clusters []string
	for _, c := range clusterSizes {
		clusters = append(clusters, strconv.Itoa(c))
	}
	if got := cppArray(t, h, "int", "kClusterSizes"); !slices.Equal(got, clusters) {
		t.Errorf("vocab.h kClusterSizes is %v, the tables %v", got, clusters)
	}
	for name, want := range map[string]int{"kVectorBytes": vectorBytes, "kMaxHidden": maxHidden,
		"kGenericMaxThreads": genericMaxThreads, "kMaxVecsPerThread": maxVecsPerThread,
		"kQuantGroup": quantGroup, "kMaxWorld": maxWorld, "kMaxTopK": maxTopK} {
		if got := cppConst(t, h, name); got != want {
			t.Errorf("vocab.h %s = %d, the tables %d", name, got, want)
		}
	}
	m := regexp.MustCompile(`(?m)^#define ARFUSE_DEVICE_API_VERSION (\d+)$`).FindSubmatch(h)
	if m == nil || string(m[1]) != strconv.Itoa(apiVersion) {
		t.Errorf("vocab.h: ARFUSE_DEVICE_API_VERSION is %q, the tables %d", m, apiVersion)
	}
	if slices.Max(worldSizes) > maxWorld {
		t.Errorf("worldSizes %v go beyond maxWorld %d", worldSizes, maxWorld)
	}
}

// pyOutput is one output kind row of arfuse/_vocab_tables.py.
type pyOutput struct {
	Name    string `json:"name"`
	Torch   string `json:"torch"`
	Scales  string `json:"scales"`
	Group   int    `json:"group"`
	Bounded bool   `json:"bounded"`
	Layouts bool   `json:"layouts"`
}

// pyDType is one dtype row of arfuse/_vocab_tables.py.
type pyDType struct {
	Name  string `json:"name"`
	Torch string `json:"torch"`
	Bytes int    `json:"bytes"`
}

// pyVocab is TABLES of arfuse/_vocab_tables.py, the shape arfuse/_vocab.py reads.
type pyVocab struct {
	DTypes          []pyDType      `json:"dtypes"`
	Algorithms      []string       `json:"algorithms"`
	LocalAlgorithms []string       `json:"local_algorithms"`
	Outputs         []pyOutput     `json:"outputs"`
	Limits          map[string]int `json:"limits"`
}

// pyLiteralAsJSON turns the Python literal the template prints (dicts, lists, strings without
// escapes, ints, True/False, trailing commas) into JSON, so that the test reads what Python reads.
func pyLiteralAsJSON(src string) string {
	src = regexp.MustCompile(`\bTrue\b`).ReplaceAllString(src, "true")
	src = regexp.MustCompile(`\bFalse\b`).ReplaceAllString(src, "false")
	return regexp.MustCompile(`,(\s*[\]}])`).ReplaceAllString(src, "$1")
}

// The generated Python module, read back: TABLES is exactly what the Go tables say, in the shape
// arfuse/_vocab.py builds its names from, and API_VERSION is the tables' version.
func TestVocabPython(t *testing.T) {
	src := string(renderedVocab(t)["arfuse/_vocab_tables.py"])
	m := regexp.MustCompile(`(?s)\nTABLES = (\{\n.*?\n\})\n`).FindStringSubmatch(src)
	if m == nil {
		t.Fatal("arfuse/_vocab_tables.py has no TABLES = {...}")
	}
	dec := json.NewDecoder(strings.NewReader(pyLiteralAsJSON(m[1])))
	dec.DisallowUnknownFields()
	var got pyVocab
	if err := dec.Decode(&got); err != nil {
		t.Fatalf("arfuse/_vocab_tables.py TABLES: %v\n%s", err, m[1])
	}
	var want pyVocab
	for _, d := range dtypes {
		want.DTypes = append(want.DTypes, pyDType{d.Name, d.Torch, d.Size})
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
	// The keys arfuse/_vocab.py and its users read (LIMITS["max_world"], ...).
	want.Limits = map[string]int{
		"vector_bytes": vectorBytes, "max_hidden": maxHidden, "generic_max_threads": genericMaxThreads,
		"max_vecs_per_thread": maxVecsPerThread, "max_world": maxWorld, "max_top_k": maxTopK,
		"quant_group": quantGroup,
	}
	if !reflect.DeepEqual(got, want) {
		g, _ := json.Marshal(got)
		w, _ := json.Marshal(want)
		t.Errorf("arfuse/_vocab_tables.py TABLES is not gen/tables.go:\n got %s\nwant %s", g, w)
	}
	if !regexp.MustCompile(`(?m)^API_VERSION = ` + strconv.Itoa(apiVersion) + `$`).MatchString(src) {
		t.Errorf("arfuse/_vocab_tables.py has no API_VERSION = %d", apiVersion)
	}
	if regexp.MustCompile(`(?m)^(import|from) `).MatchString(src) {
		t.Error("arfuse/_vocab_tables.py imports something: it is plain data, importable without torch")
	}
}

// The plan refuses tables the templates could not print: a name that would need escaping, an
// enum whose rows name different enums.
func TestVocabRejects(t *testing.T) {
	if _, err := newEnum("d", []string{"a", "b"}, []string{"arfuse::E::kA", "arfuse::F::kB"}); err == nil ||
		!strings.Contains(err.Error(), "not in arfuse::E") {
		t.Errorf("mixed enums: %v", err)
	}
	if _, err := newEnum("d", []string{"a\"b"}, []string{"arfuse::E::kA"}); err == nil {
		t.Error("a name with a quote accepted")
	}
	if _, err := newEnum("d", []string{"a"}, []string{"E::kA"}); err == nil {
		t.Error("an enumerator without a namespace accepted")
	}
	e, err := newEnum("one\ntwo", []string{"a", "b"}, []string{"arfuse::host::E::kA", "arfuse::host::E::kB"})
	if err != nil || e.Namespace != "arfuse::host" || e.Type != "E" || !slices.Equal(e.DocLines, []string{"one", "two"}) ||
		!reflect.DeepEqual(e.Values, []EnumValue{{"kA", "a", 0}, {"kB", "b", 1}}) {
		t.Errorf("newEnum: %+v, %v", e, err)
	}
}

// The vocabulary is spelled once: the generated files hold it, and no hand-written file of csrc/
// or arfuse/ defines an enum, a limit or the API version of its own (or a dtype's vector width
// or size by hand).
func TestNoHandCopies(t *testing.T) {
	var limitNames []string
	for _, l := range limits {
		limitNames = append(limitNames, l.C)
	}
	copies := []struct {
		dir  string
		ext  []string
		re   *regexp.Regexp
		what string
	}{
		{"csrc", []string{".h", ".cuh", ".cpp", ".cu"}, regexp.MustCompile(`enum class (DType|Algo|OutKind|Scales)\s*[:{]`), "a vocabulary enum"},
		{"csrc", []string{".h", ".cuh", ".cpp", ".cu"}, regexp.MustCompile(`#define ARFUSE_DEVICE_API_VERSION`), "the API version"},
		{"csrc", []string{".h", ".cuh", ".cpp", ".cu"}, regexp.MustCompile(`constexpr int (` + strings.Join(limitNames, "|") + `) =`), "a kernel limit"},
		{"csrc", []string{".h", ".cuh", ".cpp", ".cu"}, regexp.MustCompile(`DType::kFP32 \? [0-9]`), "a dtype's size or vector width"},
		{"arfuse", []string{".py"}, regexp.MustCompile(`(?m)^API_VERSION = \d`), "the API version"},
		{"arfuse", []string{".py"}, regexp.MustCompile(`"(generic_max_threads|max_vecs_per_thread)": \d`), "a kernel limit"},
	}
	generated := map[string]bool{}
	for _, f := range vocabFiles {
		generated[f.Path] = true
	}
	found := map[string]int{}
	for _, c := range copies {
		err := filepath.WalkDir(filepath.Join("..", c.dir), func(p string, e fs.DirEntry, err error) error {
			if err != nil || e.IsDir() || !slices.Contains(c.ext, filepath.Ext(p)) {
				return err
			}
			rel, _ := filepath.Rel("..", p)
			rel = filepath.ToSlash(rel)
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			if c.re.Match(data) {
				if generated[rel] {
					found[c.what]++
				} else {
					t.Errorf("%s: %s of its own (%q); the vocabulary is csrc/arfuse/vocab.h and arfuse/_vocab_tables.py, generated from gen/tables.go", rel, c.what, c.re.Find(data))
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// The patterns do find what the generated files hold (the walk and the regexps work).
	for _, what := range []string{"a vocabulary enum", "the API version", "a kernel limit"} {
		if found[what] == 0 {
			t.Errorf("no generated file holds %s: the search does not see them", what)
		}
	}
}

// The hand-written kernel code reads the limits by name (csrc/arfuse/kernel.cuh, device.cuh).
func TestKernelReadsTheLimits(t *testing.T) {
	for file, uses := range map[string][]string{
		"csrc/arfuse/kernel.cuh": {"kBlockThreads = kGeneric ? kGenericMaxThreads :", "kWarpsPerToken = kGeneric ? kGenericMaxThreads / 32 :",
			"kVpt <= kMaxVecsPerThread", "is_cluster_size(kCluster)", "kWorld <= kMaxWorld"},
		"csrc/arfuse/device.cuh": {"kVec = kVectorBytes / static_cast<int>(sizeof(__nv_bfloat16))",
			"kVec = kVectorBytes / static_cast<int>(sizeof(__half))", "kVec = kVectorBytes / static_cast<int>(sizeof(float))"},
		"csrc/arfuse/params.h": {`#include "arfuse/vocab.h"`},
	} {
		src := readRepoFile(t, file)
		for _, u := range uses {
			if !bytes.Contains(src, []byte(u)) {
				t.Errorf("%s: no %q", file, u)
			}
		}
	}
}

// Every op is registered for a known dispatch key with a function csrc/arfuse/ops.h declares.
func TestOps(t *testing.T) {
	opsH := readRepoFile(t, "csrc/arfuse/ops.h")
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
