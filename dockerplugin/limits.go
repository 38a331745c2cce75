package dockerplugin

import (
	"errors"
	"net"
	"net/http"
	"sync"
	"syscall"
	"time"
)

// Limits bound the connections of the plugin socket, so that no client
// holds one for ever and no client takes them all.
type Limits struct {
	// ReadHeaderTimeout bounds reading a request's headers, ReadTimeout
	// its headers and body: bodies are small (1 MiB at most) and come
	// from local processes, so a client sending slower is cut off.
	ReadHeaderTimeout, ReadTimeout time.Duration
	// IdleTimeout closes a kept-alive connection that sends no request.
	IdleTimeout time.Duration
	// CallTimeout bounds handling one call (Handler's timeout).
	CallTimeout time.Duration
	// MaxConns bounds the connections served at once; the next ones wait
	// to be accepted until one closes.
	MaxConns int
}

// DefaultLimits are the agent's. CallTimeout is Docker's own timeout of
// its Create and Mount calls (2 min); a Mount stages and publishes.
var DefaultLimits = Limits{
	ReadHeaderTimeout: 10 * time.Second,
	ReadTimeout:       30 * time.Second,
	IdleTimeout:       time.Minute,
	CallTimeout:       2 * time.Minute,
	MaxConns:          128,
}

// writeGrace is how long an answer may take to write after its call's
// deadline (a Mount rolled back when its context ends).
const writeGrace = time.Minute

// HTTPServer is an http.Server with l's timeouts serving h, a Handler of
// CallTimeout or a wrapper of one. Its WriteTimeout, which runs from the
// end of the request's headers, outlasts reading the body, the call and
// writeGrace: it never cuts a call short, but ends the connection of a
// client that does not read its answer.
func (l Limits) HTTPServer(h http.Handler) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: l.ReadHeaderTimeout,
		ReadTimeout:       l.ReadTimeout,
		WriteTimeout:      l.ReadTimeout + l.CallTimeout + writeGrace,
		IdleTimeout:       l.IdleTimeout,
	}
}

// Listener serves at most MaxConns connections of lis at once: Accept
// waits while that many are open. Its connections still give their peer
// credentials (syscall.Conn), which the socket's access check reads.
func (l Limits) Listener(lis net.Listener) net.Listener {
	return &limitListener{Listener: lis, slots: make(chan struct{}, l.MaxConns)}
}

type limitListener struct {
	net.Listener
	slots chan struct{}
}

func (l *limitListener) Accept() (net.Conn, error) {
	l.slots <- struct{}{}
	c, err := l.Listener.Accept()
	if err != nil {
		<-l.slots
		return nil, err
	}
	return &limitedConn{Conn: c, free: func() { <-l.slots }}, nil
}

// limitedConn frees its slot when closed.
type limitedConn struct {
	net.Conn
	once sync.Once
	free func()
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.free)
	return err
}

// SyscallConn is the underlying connection's, for its peer credentials.
func (c *limitedConn) SyscallConn() (syscall.RawConn, error) {
	sc, ok := c.Conn.(syscall.Conn)
	if !ok {
		return nil, errors.New("connection has no file descriptor")
	}
	return sc.SyscallConn()
}
