package crashstate

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/url"
	"path"
	"path/filepath"
	"strconv"
	"strings"
)

// Parse reads an strace log recorded with StraceArgs and returns the
// operations on paths under root (an absolute directory) and the markers.
//
// Syscalls that failed are dropped, and so is one strace let go of before
// it returned ("<detached ...>"). An "<unfinished ...>" line and the
// "<... resumed>" line of the same thread are joined; the operation takes its
// place in the order where it completed (the resumed line). Creation modes
// are masked with the umask the log shows (umask(2) calls), 022 before the
// first one.
func Parse(r io.Reader, root string) (*Trace, error) {
	if !filepath.IsAbs(root) {
		return nil, fmt.Errorf("crashstate: root %q is not absolute", root)
	}
	root = filepath.Clean(root)
	p := &parser{
		roots:   []string{root},
		umask:   0o022,
		pending: make(map[string]string),
		cwd:     make(map[string]string),
		trace:   &Trace{Root: root},
	}
	if real, err := filepath.EvalSymlinks(root); err == nil && real != root {
		p.roots = append(p.roots, real)
	}
	br := bufio.NewReader(r)
	for n := 1; ; n++ {
		line, err := br.ReadString('\n')
		if line != "" {
			line = strings.TrimRight(line, "\r\n")
			if perr := p.line(n, line); perr != nil {
				return nil, fmt.Errorf("crashstate: strace log line %d (%.200q): %w", n, line, perr)
			}
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("crashstate: reading strace log: %w", err)
		}
	}
	return p.trace, nil
}

type parser struct {
	roots   []string
	umask   uint32
	pending map[string]string // tid -> start of an unfinished syscall
	cwd     map[string]string // tid -> working directory (from AT_FDCWD<...>)
	trace   *Trace
}

// call is one completed syscall line.
type call struct {
	tid  string
	name string
	args []string
	ret  string
	line int
}

func (p *parser) line(n int, s string) error {
	tid, rest := splitTid(s)
	switch {
	case rest == "", strings.HasPrefix(rest, "+++"), strings.HasPrefix(rest, "---"):
		return nil
	case strings.HasSuffix(rest, "<detached ...>"):
		// strace let go of the thread in the middle of the call (it
		// stops when the traced command exits, while its other threads
		// are still in syscalls): whether the call took effect is not
		// known, and nothing of that thread follows. Dropped, as a call
		// that failed.
		return nil
	case strings.HasSuffix(rest, "<unfinished ...>"):
		p.pending[tid] = strings.TrimSuffix(strings.TrimSuffix(rest, "<unfinished ...>"), " ")
		return nil
	case strings.HasPrefix(rest, "<... "):
		i := strings.Index(rest, " resumed>")
		if i < 0 {
			return fmt.Errorf("malformed resumed line %q", rest)
		}
		start, ok := p.pending[tid]
		if !ok {
			return fmt.Errorf("resumed syscall of thread %s was not started", tid)
		}
		delete(p.pending, tid)
		rest = start + strings.TrimPrefix(rest[i+len(" resumed>"):], " ")
	}
	if name, _, _ := strings.Cut(rest, "("); !modelled(name) {
		// Not a call the model reads (e.g. a syscall this strace has no
		// name for, syscall_0x...): its arguments are not parsed.
		return nil
	}
	c, ok, err := splitCall(rest)
	if err != nil || !ok {
		return err
	}
	c.tid, c.line = tid, n
	for _, a := range c.args {
		if strings.HasPrefix(a, "AT_FDCWD<") {
			if _, dir, _, err := parseFd(a); err == nil {
				p.cwd[tid] = dir
			}
		}
	}
	return p.call(c)
}

// splitTid splits the thread id strace -f prefixes a line with
// ("123  ..." with -o, "[pid   123] ..." on a terminal).
func splitTid(s string) (tid, rest string) {
	if strings.HasPrefix(s, "[pid ") {
		if i := strings.IndexByte(s, ']'); i > 0 {
			return strings.TrimSpace(s[len("[pid "):i]), strings.TrimLeft(s[i+1:], " ")
		}
	}
	i := 0
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	if i > 0 && i < len(s) && s[i] == ' ' {
		return s[:i], strings.TrimLeft(s[i:], " ")
	}
	return "", s
}

// splitCall splits "name(arg, arg) = ret". ok is false for lines that are
// not syscalls (strace's own messages).
func splitCall(s string) (c call, ok bool, err error) {
	open := strings.IndexByte(s, '(')
	if open <= 0 || !isIdent(s[:open]) {
		return call{}, false, nil
	}
	c.name = s[:open]
	depth, start := 0, open+1
	for i := open + 1; i < len(s); i++ {
		switch s[i] {
		case '"':
			j, err := skipQuoted(s, i)
			if err != nil {
				return call{}, false, err
			}
			i = j
		case '(', '[', '{', '<':
			depth++
		case ']', '}', '>':
			depth--
		case ',':
			if depth == 0 {
				c.args = append(c.args, strings.TrimSpace(s[start:i]))
				start = i + 1
			}
		case ')':
			if depth > 0 {
				depth--
				continue
			}
			if a := strings.TrimSpace(s[start:i]); a != "" || len(c.args) > 0 {
				c.args = append(c.args, a)
			}
			ret, found := strings.CutPrefix(strings.TrimLeft(s[i+1:], " "), "=")
			if !found {
				return call{}, false, fmt.Errorf("%s: no return value in %q", c.name, s)
			}
			c.ret = strings.TrimSpace(ret)
			return c, true, nil
		}
	}
	return call{}, false, fmt.Errorf("%s: unterminated argument list", c.name)
}

func isIdent(s string) bool {
	for _, r := range s {
		if !(r == '_' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9') {
			return false
		}
	}
	return s != ""
}

// skipQuoted returns the index of the quote closing the string at s[i].
func skipQuoted(s string, i int) (int, error) {
	for j := i + 1; j < len(s); j++ {
		switch s[j] {
		case '\\':
			j++
		case '"':
			return j, nil
		}
	}
	return 0, errors.New("unterminated string")
}

// unescape decodes the C escapes strace prints (\xNN, \NNN, \n, ...).
// cEscapes are the one-letter C escapes strace prints; any other escaped
// byte stands for itself.
var cEscapes = map[byte]byte{'n': '\n', 't': '\t', 'r': '\r', 'v': '\v', 'f': '\f', 'a': '\a', 'b': '\b'}

func unescape(s string) ([]byte, error) {
	out := make([]byte, 0, len(s)/4+1)
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '\\' {
			out = append(out, c)
			continue
		}
		i++
		if i >= len(s) {
			return nil, errors.New("trailing backslash")
		}
		switch e := s[i]; e {
		case 'x':
			if i+2 >= len(s) {
				return nil, errors.New("short \\x escape")
			}
			v, err := strconv.ParseUint(s[i+1:i+3], 16, 8)
			if err != nil {
				return nil, fmt.Errorf("bad \\x escape: %w", err)
			}
			out = append(out, byte(v))
			i += 2
		case '0', '1', '2', '3', '4', '5', '6', '7':
			j := i
			for j < len(s) && j < i+3 && s[j] >= '0' && s[j] <= '7' {
				j++
			}
			v, err := strconv.ParseUint(s[i:j], 8, 8)
			if err != nil {
				return nil, fmt.Errorf("bad octal escape: %w", err)
			}
			out = append(out, byte(v))
			i = j - 1
		default:
			if b, ok := cEscapes[e]; ok {
				e = b
			}
			out = append(out, e)
		}
	}
	return out, nil
}

// parseString decodes a quoted string argument; a string strace cut short
// (`"..."...`) is an error, since its data is unknown.
func parseString(a string) ([]byte, error) {
	if strings.HasSuffix(a, `"...`) {
		return nil, errors.New("string truncated by strace (record with -s 1048576)")
	}
	if len(a) < 2 || a[0] != '"' || a[len(a)-1] != '"' {
		return nil, fmt.Errorf("not a string: %.40q", a)
	}
	return unescape(a[1 : len(a)-1])
}

// atFdcwd is the fd number Parse uses for AT_FDCWD.
const atFdcwd = -100

// parseFd decodes a descriptor argument or return value printed by -y:
// "5</path>", "5</path>(deleted)", "AT_FDCWD</cwd>" or a bare number.
func parseFd(a string) (fd int, p string, deleted bool, err error) {
	num, rest, hasPath := strings.Cut(a, "<")
	if num == "AT_FDCWD" {
		fd = atFdcwd
	} else {
		v, err := strconv.Atoi(num)
		if err != nil {
			return 0, "", false, fmt.Errorf("bad descriptor %.40q: %w", a, err)
		}
		fd = v
	}
	if !hasPath {
		return fd, "", false, nil
	}
	if r, ok := strings.CutSuffix(rest, ">(deleted)"); ok {
		rest, deleted = r, true
	} else if r, ok := strings.CutSuffix(rest, ">"); ok {
		rest = r
	} else {
		return 0, "", false, fmt.Errorf("bad descriptor %.40q", a)
	}
	b, err := unescape(rest)
	if err != nil {
		return 0, "", false, fmt.Errorf("descriptor path %.40q: %w", a, err)
	}
	return fd, string(b), deleted, nil
}

func parseInt(a string) (int64, error) {
	v, err := strconv.ParseInt(a, 0, 64)
	if err != nil {
		return 0, fmt.Errorf("bad number %.40q: %w", a, err)
	}
	return v, nil
}

// parseMode decodes an octal mode argument.
func parseMode(a string) (uint32, error) {
	v, err := strconv.ParseUint(a, 0, 32)
	if err != nil {
		return 0, fmt.Errorf("bad mode %.40q: %w", a, err)
	}
	return uint32(v), nil
}

// fileMode converts a mode_t's permission bits to an fs.FileMode.
func fileMode(m uint32) fs.FileMode {
	mode := fs.FileMode(m & 0o777)
	if m&0o4000 != 0 {
		mode |= fs.ModeSetuid
	}
	if m&0o2000 != 0 {
		mode |= fs.ModeSetgid
	}
	if m&0o1000 != 0 {
		mode |= fs.ModeSticky
	}
	return mode
}

func flagSet(a string) map[string]bool {
	m := make(map[string]bool)
	for _, f := range strings.Split(a, "|") {
		m[strings.TrimSpace(f)] = true
	}
	return m
}

// rel returns p relative to the root, and whether p is under the root.
func (p *parser) rel(abs string) (string, bool) {
	abs = path.Clean(abs)
	for _, root := range p.roots {
		if abs == root {
			return ".", true
		}
		prefix := root + "/"
		if root == "/" {
			prefix = "/"
		}
		if r, ok := strings.CutPrefix(abs, prefix); ok {
			return r, true
		}
	}
	return "", false
}

// absPath resolves the path argument a relative to the directory
// descriptor argument dirfd ("" for syscalls without one).
func (p *parser) absPath(c call, dirfd, a string) (string, error) {
	b, err := parseString(a)
	if err != nil {
		return "", err
	}
	name := string(b)
	if path.IsAbs(name) {
		return path.Clean(name), nil
	}
	dir := p.cwd[c.tid]
	if dirfd != "" {
		fd, dp, _, err := parseFd(dirfd)
		if err != nil {
			return "", err
		}
		if dp != "" {
			dir = dp
		} else if fd != atFdcwd {
			return "", fmt.Errorf("%s: directory descriptor %d without a path (record with -y)", c.name, fd)
		}
	}
	if dir == "" {
		return "", fmt.Errorf("%s: relative path %q with an unknown working directory", c.name, name)
	}
	return path.Join(dir, name), nil
}

// fdArg resolves a file descriptor argument: its path relative to the root
// and whether it is under the root.
func (p *parser) fdArg(c call, a string) (fd int, rel string, deleted, under bool, err error) {
	fd, abs, deleted, err := parseFd(a)
	if err != nil {
		return 0, "", false, false, err
	}
	if abs == "" {
		return 0, "", false, false, fmt.Errorf("%s: descriptor %d without a path (record with -y)", c.name, fd)
	}
	if !path.IsAbs(abs) { // socket:[...], pipe:[...], anon_inode:...
		return fd, "", false, false, nil
	}
	rel, under = p.rel(abs)
	return fd, rel, deleted, under, nil
}

func (p *parser) add(c call, op Op) {
	op.Line = c.line
	p.trace.Ops = append(p.trace.Ops, op)
}

// modelled reports whether the model reads calls of the syscall name.
func modelled(name string) bool {
	_, ok := minArgs[name]
	return ok
}

// wantArgs checks that a syscall has at least n arguments.
func wantArgs(c call, n int) error {
	if len(c.args) < n {
		return fmt.Errorf("%s: %d arguments, want %d", c.name, len(c.args), n)
	}
	return nil
}

var minArgs = map[string]int{
	"open": 2, "openat": 3, "openat2": 3, "creat": 2,
	"write": 3, "pwrite64": 4, "writev": 3, "pwritev": 4, "pwritev2": 5, "lseek": 3,
	"ftruncate": 2, "truncate": 2, "fallocate": 4,
	"fsync": 1, "fdatasync": 1, "sync": 0, "syncfs": 1,
	"mkdir": 2, "mkdirat": 3, "rmdir": 1, "unlink": 1, "unlinkat": 3,
	"rename": 2, "renameat": 4, "renameat2": 5, "link": 2, "linkat": 5,
	"copy_file_range": 3, "sendfile": 1, "splice": 3,
	"dup": 1, "dup2": 2, "dup3": 2, "fcntl": 2, "chdir": 1, "fchdir": 1,
	"symlink": 2, "symlinkat": 3, "chmod": 2, "fchmod": 2, "fchmodat": 3, "umask": 1,
	"access": 2, "faccessat": 3, "faccessat2": 4,
}

func (p *parser) call(c call) error {
	if err := wantArgs(c, minArgs[c.name]); err != nil {
		return err
	}
	switch c.name {
	case "access":
		return p.marker(c.args[0])
	case "faccessat", "faccessat2":
		return p.marker(c.args[1])
	}
	if c.ret == "?" || strings.HasPrefix(c.ret, "-") {
		return nil // failed, or interrupted by the death of the process
	}
	switch c.name {
	case "umask":
		m, err := parseMode(c.args[0])
		if err != nil {
			return err
		}
		p.umask = m & 0o777
		return nil
	case "open":
		return p.open(c, "", c.args[0], c.args[1], argOr(c.args, 2))
	case "openat":
		return p.open(c, c.args[0], c.args[1], c.args[2], argOr(c.args, 3))
	case "openat2":
		flags, mode, err := parseOpenHow(c.args[2])
		if err != nil {
			return err
		}
		return p.open(c, c.args[0], c.args[1], flags, mode)
	case "creat":
		return p.open(c, "", c.args[0], "O_WRONLY|O_CREAT|O_TRUNC", c.args[1])
	case "write", "pwrite64", "writev", "pwritev", "pwritev2":
		return p.write(c)
	case "lseek":
		return p.fdOp(c, func(op *Op) error {
			off, err := parseInt(c.ret)
			op.Kind, op.Offset = OpSeek, off
			return err
		})
	case "ftruncate":
		return p.fdOp(c, func(op *Op) error {
			size, err := parseInt(c.args[1])
			op.Kind, op.Size = OpTruncate, size
			return err
		})
	case "fallocate":
		return p.fdOp(c, func(op *Op) error { return fallocate(c, op) })
	case "fsync", "fdatasync":
		return p.fdOp(c, func(op *Op) error {
			op.Kind = OpFsync
			return nil
		})
	case "syncfs":
		// Only a syncfs through a descriptor under the root is taken to
		// sync the root's file system.
		return p.fdOp(c, func(op *Op) error {
			*op = Op{Kind: OpSync, Fd: -1}
			return nil
		})
	case "sync":
		p.add(c, Op{Kind: OpSync, Fd: -1})
		return nil
	case "truncate":
		return p.pathOp(c, "", c.args[0], func(op *Op) error {
			size, err := parseInt(c.args[1])
			op.Kind, op.Size = OpTruncate, size
			return err
		})
	case "mkdir", "mkdirat":
		dirfd, args := atArgs(c, "mkdirat")
		return p.pathOp(c, dirfd, args[0], func(op *Op) error {
			m, err := parseMode(args[1])
			op.Kind, op.Mode = OpMkdir, fileMode(m&^p.umask)
			return err
		})
	case "rmdir", "unlink":
		return p.pathOp(c, "", c.args[0], func(op *Op) error {
			op.Kind = OpRemove
			return nil
		})
	case "unlinkat":
		return p.pathOp(c, c.args[0], c.args[1], func(op *Op) error {
			op.Kind = OpRemove
			return nil
		})
	case "chmod", "fchmodat":
		dirfd, args := atArgs(c, "fchmodat")
		return p.pathOp(c, dirfd, args[0], func(op *Op) error {
			m, err := parseMode(args[1])
			op.Kind, op.Mode = OpChmod, fileMode(m)
			return err
		})
	case "fchmod":
		return p.fdOp(c, func(op *Op) error {
			m, err := parseMode(c.args[1])
			op.Kind, op.Mode = OpChmod, fileMode(m)
			return err
		})
	case "symlink", "symlinkat":
		target, err := parseString(c.args[0])
		if err != nil {
			return err
		}
		dirfd, name := "", c.args[1]
		if c.name == "symlinkat" {
			dirfd, name = c.args[1], c.args[2]
		}
		return p.pathOp(c, dirfd, name, func(op *Op) error {
			op.Kind, op.Target = OpSymlink, string(target)
			return nil
		})
	case "rename", "renameat", "renameat2", "link", "linkat":
		return p.twoPaths(c)
	case "dup", "dup2", "dup3", "fcntl":
		if c.name == "fcntl" && c.args[1] != "F_DUPFD" && c.args[1] != "F_DUPFD_CLOEXEC" {
			return nil
		}
		return p.fdOp(c, func(op *Op) error {
			fd, _, _, err := parseFd(c.ret)
			op.Kind, op.NewFd = OpDup, fd
			return err
		})
	case "chdir":
		dir, err := p.absPath(c, "", c.args[0])
		p.cwd[c.tid] = dir
		return err
	case "fchdir":
		_, dir, _, err := parseFd(c.args[0])
		if err == nil && !path.IsAbs(dir) {
			err = fmt.Errorf("fchdir: descriptor without a path (record with -y)")
		}
		p.cwd[c.tid] = dir
		return err
	case "copy_file_range", "sendfile", "splice":
		out := c.args[0]
		if c.name != "sendfile" {
			out = c.args[2]
		}
		_, rel, _, under, err := p.fdArg(c, out)
		if err == nil && under {
			err = fmt.Errorf("%s into %s is not supported: the data copied is not recorded", c.name, rel)
		}
		return err
	}
	return nil
}

func argOr(args []string, i int) string {
	if i < len(args) {
		return args[i]
	}
	return ""
}

// atArgs returns the dirfd argument of the *at variant name of a syscall
// and the arguments after it.
func atArgs(c call, name string) (dirfd string, args []string) {
	if c.name == name {
		return c.args[0], c.args[1:]
	}
	return "", c.args
}

// parseOpenHow decodes openat2's "{flags=..., mode=..., resolve=...}".
func parseOpenHow(a string) (flags, mode string, err error) {
	inner, ok := strings.CutPrefix(a, "{")
	inner, ok2 := strings.CutSuffix(inner, "}")
	if !ok || !ok2 {
		return "", "", fmt.Errorf("openat2: bad open_how %.60q", a)
	}
	for _, f := range strings.Split(inner, ",") {
		k, v, _ := strings.Cut(strings.TrimSpace(f), "=")
		switch k {
		case "flags":
			flags = v
		case "mode":
			mode = v
		}
	}
	return flags, mode, nil
}

// marker records a Marker if the path argument a (absolute, as Mark
// passes it) is under MarkerDir.
func (p *parser) marker(a string) error {
	name, err := parseString(a)
	if err != nil {
		return err
	}
	esc, ok := strings.CutPrefix(string(name), MarkerDir+"/")
	if !ok {
		return nil
	}
	text, err := url.PathUnescape(esc)
	if err != nil {
		return fmt.Errorf("marker %q: %w", esc, err)
	}
	p.trace.Markers = append(p.trace.Markers, Marker{Text: text, Op: len(p.trace.Ops)})
	return nil
}

func (p *parser) open(c call, dirfd, name, flagArg, modeArg string) error {
	flags := flagSet(flagArg)
	abs, err := p.absPath(c, dirfd, name)
	if err != nil {
		return err
	}
	fd, retPath, _, err := parseFd(c.ret)
	if err != nil {
		return err
	}
	if flags["O_TMPFILE"] {
		if _, under := p.rel(abs); under {
			return fmt.Errorf("%s: O_TMPFILE under the root is not supported", c.name)
		}
		return nil
	}
	if path.IsAbs(retPath) {
		abs = retPath // the kernel's name, symlinks resolved
	}
	rel, under := p.rel(abs)
	if !under {
		return nil
	}
	op := Op{Kind: OpOpen, Fd: fd, Path: rel,
		Create: flags["O_CREAT"], Trunc: flags["O_TRUNC"], Append: flags["O_APPEND"]}
	if !op.Create && !op.Trunc && !flags["O_WRONLY"] && !flags["O_RDWR"] {
		if flags["O_PATH"] {
			return nil // a handle no fsync goes through
		}
		// Read-only: changes nothing, but an fsync may go through it
		// (of a file or a directory) after its name is gone.
		op.ReadOnly = true
	}
	if op.Create && modeArg != "" {
		m, err := parseMode(modeArg)
		if err != nil {
			return err
		}
		op.Mode = fileMode(m &^ p.umask)
	}
	p.add(c, op)
	return nil
}

// fdOp adds the operation fill makes for a syscall whose first argument is
// a file descriptor under the root.
func (p *parser) fdOp(c call, fill func(*Op) error) error {
	fd, rel, deleted, under, err := p.fdArg(c, c.args[0])
	if err != nil || !under {
		return err
	}
	op := Op{Fd: fd, Path: rel, Deleted: deleted}
	if err := fill(&op); err != nil {
		return fmt.Errorf("%s: %w", c.name, err)
	}
	p.add(c, op)
	return nil
}

// pathOp adds the operation fill makes for a syscall on one path under the
// root.
func (p *parser) pathOp(c call, dirfd, name string, fill func(*Op) error) error {
	abs, err := p.absPath(c, dirfd, name)
	if err != nil {
		return err
	}
	rel, under := p.rel(abs)
	if !under {
		return nil
	}
	op := Op{Fd: -1, Path: rel}
	if err := fill(&op); err != nil {
		return fmt.Errorf("%s: %w", c.name, err)
	}
	p.add(c, op)
	return nil
}

func (p *parser) write(c call) error {
	return p.fdOp(c, func(op *Op) error {
		n, err := parseInt(c.ret)
		if err != nil {
			return err
		}
		var data []byte
		op.Kind, op.Offset = OpWrite, -1
		switch c.name {
		case "write", "pwrite64":
			data, err = parseString(c.args[1])
		default:
			data, err = parseIovec(c.args[1])
		}
		if err != nil {
			return err
		}
		if n > int64(len(data)) {
			return fmt.Errorf("%d bytes written but %d recorded", n, len(data))
		}
		op.Data = data[:n]
		switch c.name {
		case "pwrite64", "pwritev":
			op.Offset, err = parseInt(c.args[3])
		case "pwritev2":
			op.Offset, err = parseInt(c.args[3])
			op.Append = flagSet(c.args[4])["RWF_APPEND"]
		}
		return err
	})
}

// parseIovec concatenates the iov_base strings of an iovec array.
func parseIovec(a string) ([]byte, error) {
	inner, ok := strings.CutPrefix(a, "[")
	inner, ok2 := strings.CutSuffix(inner, "]")
	if !ok || !ok2 {
		return nil, fmt.Errorf("bad iovec array %.60q", a)
	}
	var data []byte
	for len(inner) > 0 {
		i := strings.Index(inner, `iov_base=`)
		if i < 0 {
			break
		}
		inner = inner[i+len(`iov_base=`):]
		if !strings.HasPrefix(inner, `"`) {
			return nil, fmt.Errorf("bad iov_base %.40q", inner)
		}
		j, err := skipQuoted(inner, 0)
		if err != nil {
			return nil, err
		}
		s := inner[:j+1]
		inner = inner[j+1:]
		if strings.HasPrefix(inner, "...") {
			s += "..."
		}
		b, err := parseString(s)
		if err != nil {
			return nil, err
		}
		data = append(data, b...)
	}
	if strings.HasSuffix(a, "...]") {
		return nil, errors.New("iovec array truncated by strace (record with -s 1048576)")
	}
	return data, nil
}

func fallocate(c call, op *Op) error {
	off, err := parseInt(c.args[2])
	if err != nil {
		return err
	}
	size, err := parseInt(c.args[3])
	if err != nil {
		return err
	}
	op.Kind, op.Offset, op.Size = OpFallocate, off, size
	if c.args[1] == "0" {
		return nil
	}
	for f := range flagSet(c.args[1]) {
		switch f {
		case "FALLOC_FL_KEEP_SIZE":
			op.KeepSize = true
		case "FALLOC_FL_PUNCH_HOLE", "FALLOC_FL_ZERO_RANGE":
			op.ZeroRange = true
		case "FALLOC_FL_UNSHARE_RANGE":
		default:
			return fmt.Errorf("fallocate mode %s is not supported", f)
		}
	}
	return nil
}

// twoPaths handles rename*, link*: both paths under the root give one op;
// moving an entry out of the root removes it; bringing an inode in from
// outside is an error, since its content is unknown.
func (p *parser) twoPaths(c call) error {
	var oldDir, oldName, newDir, newName, flagArg string
	switch c.name {
	case "rename", "link":
		oldName, newName = c.args[0], c.args[1]
	default:
		oldDir, oldName, newDir, newName = c.args[0], c.args[1], c.args[2], c.args[3]
		if len(c.args) > 4 {
			flagArg = c.args[4]
		}
	}
	flags := flagSet(flagArg)
	isLink := strings.HasPrefix(c.name, "link")
	if flags["AT_EMPTY_PATH"] || flags["RENAME_WHITEOUT"] {
		return fmt.Errorf("%s: flags %s are not supported", c.name, flagArg)
	}
	oldAbs, err := p.absPath(c, oldDir, oldName)
	if err != nil {
		return err
	}
	newAbs, err := p.absPath(c, newDir, newName)
	if err != nil {
		return err
	}
	oldRel, oldUnder := p.rel(oldAbs)
	newRel, newUnder := p.rel(newAbs)
	switch {
	case !oldUnder && !newUnder:
		return nil
	case !oldUnder || (flags["RENAME_EXCHANGE"] && !newUnder):
		return fmt.Errorf("%s: %s brings %s from outside the root into it", c.name, newAbs, oldAbs)
	case !newUnder && isLink:
		return nil
	case !newUnder:
		p.add(c, Op{Kind: OpRemove, Fd: -1, Path: oldRel})
		return nil
	}
	op := Op{Kind: OpRename, Fd: -1, Path: oldRel, NewPath: newRel,
		NoReplace: flags["RENAME_NOREPLACE"], Exchange: flags["RENAME_EXCHANGE"]}
	if isLink {
		op = Op{Kind: OpLink, Fd: -1, Path: oldRel, NewPath: newRel, Follow: flags["AT_SYMLINK_FOLLOW"]}
	}
	p.add(c, op)
	return nil
}
