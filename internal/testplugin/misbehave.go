package main

import (
	"context"
	"errors"

	"io/fs"
	"os"
	"strings"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
)

// --publish-misbehave-file: NodePublishVolume misbehaves, while the file
// exists, in the way the file names (see doc.go). The responses that are
// to go out oversized or malformed are marked here, and the server's codec
// (below) writes them so: a handler cannot send bytes of its choosing.

// oversizedResponse is the size of an oversized response: above gRPC's
// default 4 MiB receive limit, which the agent keeps.
const oversizedResponse = 5 << 20

// poisonCodec is the proto codec, except for responses marked poisoned:
// those are written as an oversized or a malformed message.
type poisonCodec struct {
	base encoding.CodecV2
	mu   sync.Mutex
	// poisoned maps a response to how it is to be written.
	poisoned map[any]string
}

func newPoisonCodec() *poisonCodec {
	return &poisonCodec{base: encoding.GetCodecV2("proto"), poisoned: map[any]string{}}
}

func (c *poisonCodec) Name() string { return "proto" }

func (c *poisonCodec) poison(resp any, how string) {
	c.mu.Lock()
	c.poisoned[resp] = how
	c.mu.Unlock()
}

func (c *poisonCodec) Marshal(v any) (mem.BufferSlice, error) {
	c.mu.Lock()
	how, ok := c.poisoned[v]
	delete(c.poisoned, v)
	c.mu.Unlock()
	switch {
	case !ok:
		return c.base.Marshal(v)
	case how == "oversized":
		// A valid message: field 15 (unknown to CSI) with 5 MiB of bytes.
		b := []byte{15<<3 | 2}
		n := oversizedResponse
		for n >= 0x80 {
			b = append(b, byte(n)|0x80)
			n >>= 7
		}
		b = append(b, byte(n))
		b = append(b, make([]byte, oversizedResponse)...)
		return mem.BufferSlice{mem.SliceBuffer(b)}, nil
	default: // malformed: a truncated length-delimited field
		return mem.BufferSlice{mem.SliceBuffer([]byte{0x0a, 0xff, 0xff, 0x03, 'x'})}, nil
	}
}

func (c *poisonCodec) Unmarshal(data mem.BufferSlice, v any) error { return c.base.Unmarshal(data, v) }

// publishMisbehaviour reads --publish-misbehave-file: "" when the file is
// missing (or the flag unset).
func (p *plugin) publishMisbehaviour() (string, error) {
	if p.cfg.publishMisbehaveFile == "" {
		return "", nil
	}
	b, err := os.ReadFile(p.cfg.publishMisbehaveFile)
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", status.Errorf(codes.Internal, "read --publish-misbehave-file: %v", err)
	}
	how := strings.TrimSpace(string(b))
	switch how {
	case "hang", "die", "oversized", "malformed", "lie":
		return how, nil
	}
	return "", status.Errorf(codes.Internal, "--publish-misbehave-file %s holds %q: want hang, die, oversized, malformed or lie", p.cfg.publishMisbehaveFile, how)
}

// misbehaveBeforePublish acts on "hang" and "lie" before the volume is
// published; it reports whether the call is answered already.
func (p *plugin) misbehaveBeforePublish(ctx context.Context, how, target string) (bool, error) {
	switch how {
	case "hang":
		return true, p.hang(ctx, "--publish-misbehave-file says hang")
	case "lie":
		p.logger.Printf("NodePublishVolume: reporting success without mounting anything on %s (--publish-misbehave-file)", target)
		return true, nil
	}
	return false, nil
}

// misbehaveAfterPublish acts on "die", "oversized" and "malformed" once
// the volume is published: the mount is made, the answer is lost.
func (p *plugin) misbehaveAfterPublish(how string, resp *csi.NodePublishVolumeResponse) {
	switch how {
	case "die":
		// Once: the next process publishes normally.
		_ = os.Remove(p.cfg.publishMisbehaveFile)
		p.logger.Print("NodePublishVolume: published, now exiting with status 3 before answering (--publish-misbehave-file)")
		os.Exit(exitCrashed)
	case "oversized", "malformed":
		p.logger.Printf("NodePublishVolume: published, answering with a %s response (--publish-misbehave-file)", how)
		p.codec.poison(resp, how)
	}
}
