package main

import (
	"bytes"
	"flag"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the expected files under testdata/")

// runGen calls run and returns its exit status, stdout and stderr. A run that succeeds in writing
// must have named --root (a temporary directory, or "" for none): the default is the checkout's
// own checked-in vocabulary, which a test must not rewrite (gen --check and
// TestVocabFilesAreCurrent hold it).
func runGen(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(args, &out, &errb)
	if code == 0 && !slices.ContainsFunc(args, func(a string) bool {
		return a == "--root" || a == "--check" || a == "--list" || a == "--help"
	}) {
		t.Errorf("gen %s: wrote without --root (into the checkout's csrc/arfuse/vocab.h, arfuse/_vocab_tables.py)", strings.Join(args, " "))
	}
	return code, out.String(), errb.String()
}

// readTree reads every file under dir into a map keyed by slash path.
func readTree(t *testing.T, dir string) map[string]string {
	t.Helper()
	tree := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil || e.IsDir() {
			return err
		}
		data, err := os.ReadFile(p)
		rel, _ := filepath.Rel(dir, p)
		tree[filepath.ToSlash(rel)] = string(data)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return tree
}

func sortedKeys(m map[string]string) []string {
	var k []string
	for p := range m {
		k = append(k, p)
	}
	slices.Sort(k)
	return k
}

// caseArgs builds the command line of a testdata case: its matrix, its own models/tuning files
// when it has them (else the shared testdata ones), and the flags listed in its args file.
func caseArgs(t *testing.T, dir string) []string {
	t.Helper()
	pick := func(name string) string {
		if _, err := os.Stat(filepath.Join(dir, name)); err == nil {
			return filepath.ToSlash(filepath.Join(dir, name))
		}
		return "testdata/" + name
	}
	args := []string{"--matrix", filepath.ToSlash(filepath.Join(dir, "matrix.yaml")),
		"--models", pick("models.yaml"), "--tuning", pick("tuning.yaml"), "--root", ""}
	if data, err := os.ReadFile(filepath.Join(dir, "args")); err == nil {
		for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
			if line = strings.TrimSpace(line); line != "" {
				args = append(args, line)
			}
		}
	}
	return args
}

// TestGolden runs every testdata/<case>/: a case with stderr.txt must exit 2 printing exactly that
// line; a case with want/ must produce exactly that tree. go test ./gen -update refreshes both.
func TestGolden(t *testing.T) {
	entries, err := os.ReadDir("testdata")
	if err != nil {
		t.Fatal(err)
	}
	ran := 0
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		dir := filepath.Join("testdata", e.Name())
		ran++
		t.Run(e.Name(), func(t *testing.T) {
			args := caseArgs(t, dir)
			stderrFile := filepath.Join(dir, "stderr.txt")
			if _, err := os.Stat(stderrFile); err == nil {
				code, stdout, stderr := runGen(t, append(args, "--out", t.TempDir())...)
				if *update {
					if err := os.WriteFile(stderrFile, []byte(stderr), 0o644); err != nil {
						t.Fatal(err)
					}
				}
				want, _ := os.ReadFile(stderrFile)
				if code != 2 || stdout != "" || stderr != string(want) {
					t.Errorf("exit %d, stdout %q\n got stderr %q\nwant stderr %q", code, stdout, stderr, want)
				}
				if strings.Count(stderr, "\n") != 1 {
					t.Errorf("stderr is not one line: %q", stderr)
				}
				return
			}
			wantDir := filepath.Join(dir, "want")
			if *update {
				if err := os.RemoveAll(wantDir); err != nil {
					t.Fatal(err)
				}
				if code, _, stderr := runGen(t, append(args, "--out", wantDir)...); code != 0 {
					t.Fatalf("update: exit %d: %s", code, stderr)
				}
			}
			out := t.TempDir()
			if code, _, stderr := runGen(t, append(args, "--out", out)...); code != 0 {
				t.Fatalf("exit %d: %s", code, stderr)
			}
			got, want := readTree(t, out), readTree(t, wantDir)
			if len(want) == 0 {
				t.Fatalf("%s is empty: run go test ./gen -update", wantDir)
			}
			for _, p := range sortedKeys(want) {
				if g, ok := got[p]; !ok {
					t.Errorf("%s: not generated", p)
				} else if g != want[p] {
					t.Errorf("%s differs from %s (go test ./gen -update refreshes it):\n%s", p, filepath.Join(wantDir, p), g)
				}
			}
			for _, p := range sortedKeys(got) {
				if _, ok := want[p]; !ok {
					t.Errorf("%s: generated but not in %s", p, wantDir)
				}
			}
		})
	}
	if ran < 10 {
		t.Errorf("only %d golden cases found", ran)
	}
}

// repoRoot switches the test to the repository root, where the default flags resolve.
func repoRoot(t *testing.T) {
	t.Helper()
	t.Chdir("..")
}

func TestRealMatrices(t *testing.T) {
	repoRoot(t)
	counts := map[string]int{"default": 130, "ci": 41, "full": 666}
	for _, m := range []string{"default", "ci", "full"} {
		args := []string{"--list"}
		if m != "default" {
			args = append(args, "--matrix", m)
		}
		code, stdout, stderr := runGen(t, args...)
		if code != 0 || stderr != "" {
			t.Fatalf("%s: exit %d: %s", m, code, stderr)
		}
		lines := strings.Split(strings.TrimSuffix(stdout, "\n"), "\n")
		if len(lines) != counts[m] {
			t.Errorf("%s: %d variants, want %d", m, len(lines), counts[m])
		}
		if !slices.IsSorted(lines) {
			t.Errorf("%s: --list is not sorted", m)
		}
		for _, l := range lines {
			if !regexp.MustCompile(`^arfuse_(bf16|fp16|fp32)_(h\d+_w\d+|generic)_(oneshot|twoshot|local)_(norm|fp8_static|fp8_token|fp8_group128)(_upto\d+)?$`).MatchString(l) {
				t.Errorf("%s: odd name %q", m, l)
			}
			// World size 1 is the local algorithm's, and local is world size 1's.
			if strings.Contains(l, "_w1_") != (strings.Contains(l, "_local_") && !strings.Contains(l, "_generic_")) {
				t.Errorf("%s: %q: world size 1 and the local algorithm go together", m, l)
			}
			if m == "ci" && strings.Contains(l, "_h2880_") {
				t.Errorf("ci.yaml specialises 2880, which the GPU tests use for the generic path: %s", l)
			}
		}
	}
}

func TestOnlyAndList(t *testing.T) {
	repoRoot(t)
	code, stdout, _ := runGen(t, "--list", "--only", "arfuse_bf16_h7168_*_norm")
	want := "arfuse_bf16_h7168_w1_local_norm\n" +
		"arfuse_bf16_h7168_w2_oneshot_norm\narfuse_bf16_h7168_w2_twoshot_norm\narfuse_bf16_h7168_w4_oneshot_norm\n" +
		"arfuse_bf16_h7168_w4_twoshot_norm\narfuse_bf16_h7168_w8_oneshot_norm\narfuse_bf16_h7168_w8_twoshot_norm\n"
	if code != 0 || stdout != want {
		t.Errorf("exit %d\n%s", code, stdout)
	}
	// Generic instances are names too; several --only are a union.
	code, stdout, _ = runGen(t, "--list", "--only", "*_generic_*", "--only", "arfuse_fp16_h2880_w2_oneshot_norm")
	want = "arfuse_bf16_generic_local_fp8_group128\narfuse_bf16_generic_local_fp8_static\narfuse_bf16_generic_local_fp8_token\narfuse_bf16_generic_local_norm\n" +
		"arfuse_bf16_generic_oneshot_fp8_group128\narfuse_bf16_generic_oneshot_fp8_static\narfuse_bf16_generic_oneshot_fp8_token\narfuse_bf16_generic_oneshot_norm\n" +
		"arfuse_bf16_generic_twoshot_fp8_group128\narfuse_bf16_generic_twoshot_fp8_static\narfuse_bf16_generic_twoshot_fp8_token\narfuse_bf16_generic_twoshot_norm\n" +
		"arfuse_fp16_generic_local_norm\narfuse_fp16_generic_oneshot_norm\narfuse_fp16_generic_twoshot_norm\narfuse_fp16_h2880_w2_oneshot_norm\n" +
		"arfuse_fp32_generic_local_norm\narfuse_fp32_generic_oneshot_norm\narfuse_fp32_generic_twoshot_norm\n"
	if code != 0 || stdout != want {
		t.Errorf("exit %d\n%s", code, stdout)
	}
	// --only shapes the generated tree.
	out := t.TempDir()
	if code, _, stderr := runGen(t, "--matrix", "ci", "--out", out, "--root", "", "--only", "*_h7168_w8_*"); code != 0 {
		t.Fatal(stderr)
	}
	var kernels []string
	for p := range readTree(t, out) {
		if strings.HasPrefix(p, "kernels/") {
			kernels = append(kernels, p)
		}
	}
	slices.Sort(kernels)
	if strings.Join(kernels, " ") != "kernels/arfuse_bf16_h7168_w8_oneshot_fp8_group128.cu kernels/arfuse_bf16_h7168_w8_oneshot_fp8_token.cu "+
		"kernels/arfuse_bf16_h7168_w8_oneshot_norm.cu kernels/arfuse_bf16_h7168_w8_twoshot_fp8_group128.cu "+
		"kernels/arfuse_bf16_h7168_w8_twoshot_fp8_token.cu kernels/arfuse_bf16_h7168_w8_twoshot_norm.cu "+
		"kernels/arfuse_bf16_h7168_w8_twoshot_norm_upto16.cu" {
		t.Errorf("kernels %v", kernels)
	}
}

func TestFlags(t *testing.T) {
	repoRoot(t)
	code, stdout, _ := runGen(t, "--help")
	if code != 0 || !strings.Contains(stdout, "--matrix") || !strings.Contains(stdout, "--check") {
		t.Errorf("--help: exit %d\n%s", code, stdout)
	}
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"--nope"}, "gen: unknown flag: --nope (see --help)\n"},
		{[]string{"extra"}, "gen: unexpected argument \"extra\" (see --help)\n"},
		{[]string{"--list", "--check"}, "gen: --list and --check cannot be combined\n"},
		{[]string{"--matrix", "nope", "--root", ""}, "variants/nope.yaml: cannot read: no such file or directory\n"},
		{[]string{"--list", "--only", "["}, "--only: \"[\": bad glob: syntax error in pattern\n"},
		{[]string{"--list", "--only", "arfuse_bf8_*"}, "--only: \"arfuse_bf8_*\": matches no variant of variants/default.yaml\n"},
	}
	for _, c := range cases {
		code, stdout, stderr := runGen(t, c.args...)
		if code != 2 || stdout != "" || stderr != c.want {
			t.Errorf("%v: exit %d stdout %q\n got %q\nwant %q", c.args, code, stdout, stderr, c.want)
		}
	}
}

func TestCheck(t *testing.T) {
	repoRoot(t)
	out := filepath.Join(t.TempDir(), "out")
	check := func() (int, string) {
		code, _, stderr := runGen(t, "--matrix", "ci", "--out", out, "--root", "", "--check")
		return code, stderr
	}
	if code, stderr := check(); code != 1 || !strings.Contains(stderr, filepath.Join(out, "dispatch.cu")+": missing\n") {
		t.Errorf("empty dir: exit %d\n%s", code, stderr)
	}
	if _, err := os.Stat(out); err == nil {
		t.Errorf("--check wrote %s", out)
	}
	if code, _, stderr := runGen(t, "--matrix", "ci", "--out", out, "--root", ""); code != 0 {
		t.Fatal(stderr)
	}
	if code, stderr := check(); code != 0 || stderr != "" {
		t.Errorf("matching tree: exit %d\n%s", code, stderr)
	}
	// A hand-written file in the output directory is not the generator's business.
	if err := os.WriteFile(filepath.Join(out, "notes.txt"), []byte("mine\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if code, stderr := check(); code != 0 {
		t.Errorf("foreign file: exit %d\n%s", code, stderr)
	}
	edited := filepath.Join(out, "kernels", "arfuse_bf16_h7168_w8_oneshot_norm.cu")
	if err := os.WriteFile(edited, []byte("// Code generated by go run ./gen ... edited\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	stale := filepath.Join(out, "kernels", "arfuse_bf16_h9999_w8_oneshot_norm.cu")
	if err := os.WriteFile(stale, []byte("// Code generated by go run ./gen from x. DO NOT EDIT.\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(out, "sources.mk")); err != nil {
		t.Fatal(err)
	}
	code, stderr := check()
	want := edited + ": differs\n" + stale + ": extra\n" + filepath.Join(out, "sources.mk") + ": missing\n" +
		"gen: " + out + " is not what go run ./gen would write (3 files); rerun it\n"
	if code != 1 || stderr != want {
		t.Errorf("exit %d\n got %s\nwant %s", code, stderr, want)
	}
	// Regenerating repairs all three and leaves the foreign file.
	if code, _, stderr := runGen(t, "--matrix", "ci", "--out", out, "--root", ""); code != 0 {
		t.Fatal(stderr)
	}
	if code, stderr := check(); code != 0 {
		t.Errorf("after regenerating: exit %d\n%s", code, stderr)
	}
	if _, err := os.Stat(filepath.Join(out, "notes.txt")); err != nil {
		t.Errorf("foreign file removed: %v", err)
	}
}

// --root: the checked-in vocabulary is written there and compared there like --out, but nothing
// else under it is looked at or removed; a root without their directories, and an --out that holds
// them, are refused before anything is written.
func TestCheckRoot(t *testing.T) {
	repoRoot(t)
	root, out := t.TempDir(), filepath.Join(t.TempDir(), "out")
	for _, d := range []string{"csrc/arfuse", "arfuse"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	header, module := filepath.Join(root, "csrc", "arfuse", "vocab.h"), filepath.Join(root, "arfuse", "_vocab_tables.py")
	if code, _, stderr := runGen(t, "--matrix", "ci", "--out", out, "--root", ""); code != 0 {
		t.Fatal(stderr)
	}
	check := func() (int, string) {
		code, _, stderr := runGen(t, "--matrix", "ci", "--out", out, "--root", root, "--check")
		return code, stderr
	}
	want := module + ": missing\n" + header + ": missing\n" +
		"gen: the checked-in vocabulary under " + root + " is not what go run ./gen would write (2 files); rerun it\n"
	if code, stderr := check(); code != 1 || stderr != want {
		t.Errorf("empty root: exit %d\n got %s\nwant %s", code, stderr, want)
	}
	// A stale generated file and a foreign file under the root stay: it is not swept.
	stale := filepath.Join(root, "csrc", "arfuse", "old.h")
	foreign := filepath.Join(root, "arfuse", "mine.py")
	for _, p := range []string{stale, foreign} {
		if err := os.WriteFile(p, []byte("# Code generated by go run ./gen from x. DO NOT EDIT.\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if code, _, stderr := runGen(t, "--matrix", "ci", "--out", out, "--root", root); code != 0 {
		t.Fatal(stderr)
	}
	if code, stderr := check(); code != 0 || stderr != "" {
		t.Errorf("written root: exit %d\n%s", code, stderr)
	}
	for _, p := range []string{stale, foreign} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("the root was swept: %v", err)
		}
	}
	// They are what the checkout holds (TestVocabFilesAreCurrent: what the tables say).
	for rel, p := range map[string]string{"csrc/arfuse/vocab.h": header, "arfuse/_vocab_tables.py": module} {
		got, _ := os.ReadFile(p)
		if mine, _ := os.ReadFile(rel); string(got) != string(mine) {
			t.Errorf("%s differs from the checkout's %s", p, rel)
		}
	}
	// An edit is found, both trees are reported, and the status is 1.
	if err := os.WriteFile(header, []byte("// edited\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(out, "sources.mk")); err != nil {
		t.Fatal(err)
	}
	want = filepath.Join(out, "sources.mk") + ": missing\n" + header + ": differs\n" +
		"gen: " + out + " is not what go run ./gen would write (1 files); rerun it\n" +
		"gen: the checked-in vocabulary under " + root + " is not what go run ./gen would write (1 files); rerun it\n"
	if code, stderr := check(); code != 1 || stderr != want {
		t.Errorf("edited: exit %d\n got %s\nwant %s", code, stderr, want)
	}
	// --root "" leaves the checked-in files alone: neither written nor compared.
	if code, _, stderr := runGen(t, "--matrix", "ci", "--out", out, "--root", ""); code != 0 {
		t.Fatal(stderr)
	}
	if code, _, stderr := runGen(t, "--matrix", "ci", "--out", out, "--root", "", "--check"); code != 0 || stderr != "" {
		t.Errorf("--root \"\" --check: exit %d\n%s", code, stderr)
	}
	if data, _ := os.ReadFile(header); string(data) != "// edited\n" {
		t.Error("--root \"\" wrote the header")
	}
	// Refused: a root that is not the repository root, an --out that holds the checked-in files.
	elsewhere := t.TempDir()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--matrix", "ci", "--out", out, "--root", elsewhere},
			"--root: \"" + elsewhere + "\": has no directory arfuse/ for arfuse/_vocab_tables.py: not the repository root (--root \"\" leaves the checked-in files alone)\n"},
		{[]string{"--matrix", "ci", "--out", filepath.Join(root, "csrc"), "--root", root},
			"--out: \"" + filepath.Join(root, "csrc") + "\": holds the checked-in csrc/arfuse/vocab.h (--out is swept for stale generated files): pick a directory of its own\n"},
	} {
		code, stdout, stderr := runGen(t, c.args...)
		if code != 2 || stdout != "" || stderr != c.want {
			t.Errorf("%v: exit %d\n got %q\nwant %q", c.args, code, stderr, c.want)
		}
	}
	if entries, _ := os.ReadDir(elsewhere); len(entries) != 0 {
		t.Errorf("a refused --root got %d entries", len(entries))
	}
}

func TestByteIdentical(t *testing.T) {
	repoRoot(t)
	a, b := t.TempDir(), t.TempDir()
	for _, dir := range []string{a, b} {
		if code, _, stderr := runGen(t, "--matrix", "ci", "--out", dir, "--root", ""); code != 0 {
			t.Fatal(stderr)
		}
	}
	ta, tb := readTree(t, a), readTree(t, b)
	if len(ta) != 41+6 {
		t.Errorf("%d files, want 47", len(ta))
	}
	for p, data := range ta {
		if tb[p] != data {
			t.Errorf("%s differs between two runs", p)
		}
		if !strings.Contains(data[:min(len(data), 512)], generatedMarker) {
			t.Errorf("%s has no generated header", p)
		}
	}
	// --out does not leak into the files: the same matrix in another directory is the same tree.
	if len(tb) != len(ta) {
		t.Errorf("trees differ in size")
	}
}

// The exit statuses the README documents hold for the way it tells people to run the generator:
// the binary that make gen builds (go build -o build/bin/gen ./gen), run from the repository root.
// (go run would report each non-zero status as 1 and print "exit status N" after the message.)
func TestBinaryExitStatus(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	bin := filepath.Join(t.TempDir(), "gen")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	repoRoot(t)
	out := t.TempDir()
	bad, _ := os.ReadFile("gen/testdata/bad_dtype/stderr.txt")
	for _, c := range []struct {
		args   []string
		code   int
		stderr string // exact; "*" for anything non-empty
	}{
		{[]string{"--help"}, 0, ""},
		{[]string{"--list", "--matrix", "ci"}, 0, ""},
		{[]string{"--matrix", "ci", "--out", out, "--root", ""}, 0, ""},
		{[]string{"--matrix", "ci", "--out", out, "--check"}, 0, ""},
		{[]string{"--matrix", "default", "--out", out, "--check"}, 1, "*"},
		{[]string{"--matrix", "gen/testdata/bad_dtype/matrix.yaml", "--models", "gen/testdata/models.yaml", "--tuning", "gen/testdata/tuning.yaml", "--out", out}, 2, "gen/" + string(bad)},
		{[]string{"--nope"}, 2, "gen: unknown flag: --nope (see --help)\n"},
	} {
		cmd := exec.Command(bin, c.args...)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		if code != c.code || (c.stderr == "*" && stderr.Len() == 0) || (c.stderr != "*" && stderr.String() != c.stderr) {
			t.Errorf("gen %s: exit %d, stderr %q; want exit %d, stderr %q", strings.Join(c.args, " "), code, stderr.String(), c.code, c.stderr)
		}
		if strings.Contains(stderr.String(), "exit status") {
			t.Errorf("gen %s: stderr has an \"exit status\" line: %q", strings.Join(c.args, " "), stderr.String())
		}
	}
}
