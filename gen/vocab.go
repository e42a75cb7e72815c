package main

// The vocabulary files: the tables of tables.go printed for the C++ code (csrc/arfuse/vocab.h) and
// the Python package (arfuse/_vocab_tables.py). Unlike out/, they are checked in (the GPU machine
// builds the library and installs the package without Go) and do not depend on the matrix: every
// run renders them, writes them under --root (the repository root) when their bytes changed, and
// --check compares them (torchgen's checked-in outputs, kept current by CI).
//
// Same four steps as out/: the tables are the model, newVocab is the plan (each C++ enumerator
// split into the namespace, type and name the header prints, each rule checked here so that the
// templates only print), templates/vocab/*.tmpl render, write.go writes.

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
)

// vocabFiles maps each checked-in generated file (a path relative to the repository root) to its
// template under templates/.
var vocabFiles = []struct{ Path, Template string }{
	{"csrc/arfuse/vocab.h", "vocab/vocab.h.tmpl"},
	{"arfuse/_vocab_tables.py", "vocab/_vocab_tables.py.tmpl"},
}

// Vocab is everything the vocabulary templates print.
type Vocab struct {
	APIVersion int
	Limits     []Limit
	Clusters   []int // cluster sizes besides 1, largest first
	// The C++ namespaces in the order printed: limitsNamespace first (the limits and the cluster
	// sizes), then each other namespace that holds an enum, in table order.
	Namespaces []*Namespace
	// The Python rows, each table in value order.
	DTypes     []*DType
	Algos      []*Algo // the whole arfuse::Algo enum, auto first
	LocalAlgos []string
	OutKinds   []*OutKind
}

// Namespace is one namespace block of the C++ header.
type Namespace struct {
	Name   string
	Limits bool // the limits and cluster sizes go here
	Enums  []*Enum
}

// limitsNamespace holds the C++ limits (arfuse::kMaxWorld).
const limitsNamespace = "arfuse"

// Enum is one C++ enum class over int32_t, printed with a names array (k<Type>Names).
type Enum struct {
	Namespace string   // arfuse, arfuse::host
	Type      string   // DType
	DocLines  []string // the comment above it, line by line
	Values    []EnumValue
	// Bytes: per value, bytes per element (the dtype enum's k<Type>Bytes array); nil for none.
	Bytes []int
}

// EnumValue is one enumerator: value Value is spelled Enumerator in C++ and Name elsewhere.
type EnumValue struct {
	Enumerator string // kBF16
	Name       string // bf16
	Value      int
}

// vocabName is what every name the vocabulary prints into C++ and Python string literals
// (and Python dict keys) must look like: nothing to escape in either language.
var vocabName = regexp.MustCompile(`^[a-z][a-z0-9_]*$`)

// cppIdent is a C++ identifier, a namespace or an enumerator.
var cppIdent = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// newEnum splits each row's qualified enumerator (arfuse::DType::kBF16) into the namespace, the
// enum type and the enumerator; every row of one table must name the same enum.
func newEnum(doc string, names, qualified []string) (*Enum, error) {
	e := &Enum{DocLines: strings.Split(doc, "\n")}
	for i, q := range qualified {
		parts := strings.Split(q, "::")
		if len(parts) < 3 {
			return nil, fmt.Errorf("tables.go: enumerator %q is not namespace::Type::kName", q)
		}
		ns, typ, enumerator := strings.Join(parts[:len(parts)-2], "::"), parts[len(parts)-2], parts[len(parts)-1]
		for _, id := range parts {
			if !cppIdent.MatchString(id) {
				return nil, fmt.Errorf("tables.go: enumerator %q: %q is not a C++ identifier", q, id)
			}
		}
		if i == 0 {
			e.Namespace, e.Type = ns, typ
		} else if ns != e.Namespace || typ != e.Type {
			return nil, fmt.Errorf("tables.go: enumerator %q is not in %s::%s like the rows before it", q, e.Namespace, e.Type)
		}
		if !vocabName.MatchString(names[i]) {
			return nil, fmt.Errorf("tables.go: %s name %q is not lower-case letters, digits and _", typ, names[i])
		}
		e.Values = append(e.Values, EnumValue{Enumerator: enumerator, Name: names[i], Value: i})
	}
	if len(e.Values) == 0 {
		return nil, fmt.Errorf("tables.go: an enum with no rows (%s)", doc)
	}
	return e, nil
}

// enumOf is newEnum over a table.
func enumOf[T any](doc string, table []T, name, enum func(T) string) (*Enum, error) {
	var names, qualified []string
	for _, e := range table {
		names = append(names, name(e))
		qualified = append(qualified, enum(e))
	}
	return newEnum(doc, names, qualified)
}

// newVocab gathers what the vocabulary templates print, checking what they rely on.
func newVocab() (*Vocab, error) {
	v := &Vocab{APIVersion: apiVersion, Limits: limits, Clusters: clusterSizes, DTypes: dtypes,
		Algos: allAlgos(), OutKinds: outKinds}
	for _, l := range limits {
		if !vocabName.MatchString(l.Py) || !cppIdent.MatchString(l.C) {
			return nil, fmt.Errorf("tables.go: limit %q / %q: odd spelling", l.Py, l.C)
		}
	}
	for _, a := range v.Algos {
		if a.Local {
			v.LocalAlgos = append(v.LocalAlgos, a.Name)
		}
	}
	for _, o := range outKinds {
		if o.Torch != "" && !vocabName.MatchString(o.Torch) {
			return nil, fmt.Errorf("tables.go: output kind %s: torch dtype %q", o.Name, o.Torch)
		}
	}
	dt, err := enumOf("Scalar types (the activation dtypes), with their names and bytes per element.",
		dtypes, func(d *DType) string { return d.Name }, func(d *DType) string { return d.Enum })
	if err != nil {
		return nil, err
	}
	for _, d := range dtypes {
		if !vocabName.MatchString(d.Torch) || d.Size <= 0 || vectorBytes%d.Size != 0 {
			return nil, fmt.Errorf("tables.go: dtype %s: torch %q, %d bytes", d.Name, d.Torch, d.Size)
		}
		dt.Bytes = append(dt.Bytes, d.Size)
	}
	al, err := enumOf("Algorithms. kAuto is resolved on the host: kLocal at world size 1, else one-shot or two-shot by\n"+
		"the tuned threshold. kLocal is the world-size-1 op (finalize + shared add + residual + RMSNorm,\n"+
		"no communication: no workspace, no waits) and serves world size 1 only; the all-reduce\n"+
		"algorithms serve world sizes 2 and up.",
		v.Algos, func(a *Algo) string { return a.Name }, func(a *Algo) string { return a.Enum })
	if err != nil {
		return nil, err
	}
	ok, err := enumOf("Output kinds: what the kernel writes after the RMSNorm (csrc/arfuse/params.h says how each\n"+
		"computes its codes and scales; csrc/arfuse/writers.cuh writes them).",
		outKinds, func(o *OutKind) string { return o.Name }, func(o *OutKind) string { return o.Enum })
	if err != nil {
		return nil, err
	}
	sc, err := enumOf("How an output kind's scale arrives or is written (csrc/host/out_kinds.h):\n"+
		"  kNone      no scale (fused without fp8_scale);\n"+
		"  kInput     a float32 one-element input (fused's fp8_scale);\n"+
		"  kPerToken  written by the kernel, float32 [T] (fused_fp8_dynamic, group_size 0);\n"+
		"  kPerGroup  written, float32 [T, H / group], row- or column-major (group_size = group).",
		scaleRules, func(r *ScaleRule) string { return r.Name }, func(r *ScaleRule) string { return r.Enum })
	if err != nil {
		return nil, err
	}
	v.Namespaces = []*Namespace{{Name: limitsNamespace, Limits: true}}
	for _, e := range []*Enum{dt, al, ok, sc} {
		i := slices.IndexFunc(v.Namespaces, func(n *Namespace) bool { return n.Name == e.Namespace })
		if i < 0 {
			i = len(v.Namespaces)
			v.Namespaces = append(v.Namespaces, &Namespace{Name: e.Namespace})
		}
		v.Namespaces[i].Enums = append(v.Namespaces[i].Enums, e)
	}
	return v, nil
}

// vocabData is what one vocabulary template execution sees.
type vocabData struct {
	Template string // repo-relative path of the template being executed
	V        *Vocab
}

// renderVocab renders the checked-in files, keyed by their path relative to the repository root.
func renderVocab(v *Vocab) (Files, error) {
	t, err := loadTemplates()
	if err != nil {
		return nil, err
	}
	files := Files{}
	for _, f := range vocabFiles {
		data, err := renderOne(t, f.Template, vocabData{Template: templateDir + "/" + f.Template, V: v})
		if err != nil {
			return nil, err
		}
		if err := files.Add(f.Path, data); err != nil {
			return nil, err
		}
	}
	return files, nil
}
