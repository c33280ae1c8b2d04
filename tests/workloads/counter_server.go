// counter_server ADDR: the "counter protocol" HTTP server of
// tests/tests/daemons.rs, in Go (net/http: a goroutine per connection on
// GOMAXPROCS threads). Run in the foreground as a systemd service would
// run it; stops cleanly on SIGTERM (exit 0).
//
//	GET /add/KEY/N  adds N to KEY, answers its new value
//	GET /sum        "KEYS TOTAL ADDS" over all keys
//	GET /check      "OK ..." if the server's own state is consistent:
//	                the values add up to the total, and the hash chains
//	                that background goroutines extend every millisecond
//	                recompute to the same digests; "FAIL ..." otherwise
package main

import (
	"context"
	"crypto/sha256"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

const chains = 8

type chain struct {
	mu   sync.Mutex
	n    uint64
	hash [32]byte
}

func (c *chain) step(id int) {
	c.mu.Lock()
	c.n++
	c.hash = sha256.Sum256(append(c.hash[:], []byte(fmt.Sprintf("%d/%d", id, c.n))...))
	c.mu.Unlock()
}

// verify recomputes the chain from scratch.
func (c *chain) verify(id int) error {
	c.mu.Lock()
	n, h := c.n, c.hash
	c.mu.Unlock()
	var x [32]byte
	for i := uint64(1); i <= n; i++ {
		x = sha256.Sum256(append(x[:], []byte(fmt.Sprintf("%d/%d", id, i))...))
	}
	if x != h {
		return fmt.Errorf("chain %d: digest after %d steps differs", id, n)
	}
	return nil
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: counter_server ADDR")
		os.Exit(2)
	}
	var mu sync.Mutex
	vals := map[string]int64{}
	var total, adds int64
	var cs [chains]chain
	for i := range cs {
		go func(id int) {
			for {
				cs[id].step(id)
				time.Sleep(time.Millisecond)
			}
		}(i)
	}
	answer := func(w http.ResponseWriter, s string) {
		w.Header().Set("Content-Length", strconv.Itoa(len(s)))
		w.Write([]byte(s))
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/add/", func(w http.ResponseWriter, r *http.Request) {
		parts := strings.Split(strings.TrimPrefix(r.URL.Path, "/add/"), "/")
		if len(parts) != 2 {
			http.Error(w, "bad path", 400)
			return
		}
		n, err := strconv.ParseInt(parts[1], 10, 64)
		if err != nil {
			http.Error(w, "bad number", 400)
			return
		}
		mu.Lock()
		vals[parts[0]] += n
		total += n
		adds++
		v := vals[parts[0]]
		mu.Unlock()
		answer(w, strconv.FormatInt(v, 10))
	})
	mux.HandleFunc("/sum", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		s := fmt.Sprintf("%d %d %d", len(vals), total, adds)
		mu.Unlock()
		answer(w, s)
	})
	mux.HandleFunc("/check", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		var sum int64
		for _, v := range vals {
			sum += v
		}
		t := total
		mu.Unlock()
		if sum != t {
			answer(w, fmt.Sprintf("FAIL values add up to %d, total %d", sum, t))
			return
		}
		for i := range cs {
			if err := cs[i].verify(i); err != nil {
				answer(w, "FAIL "+err.Error())
				return
			}
		}
		answer(w, fmt.Sprintf("OK %d keys, %d chains verified", len(vals), chains))
	})
	ln, err := net.Listen("tcp", os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "listen:", err)
		os.Exit(1)
	}
	srv := &http.Server{Handler: mux}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM)
	done := make(chan struct{})
	go func() {
		<-sigs
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
		close(done)
	}()
	fmt.Println("listening on", ln.Addr())
	if err := srv.Serve(ln); err != http.ErrServerClosed {
		fmt.Fprintln(os.Stderr, "serve:", err)
		os.Exit(1)
	}
	<-done
	fmt.Println("stopped")
}
