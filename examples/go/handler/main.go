// Command handler is a Shoal HTTP handler in Go: the member POSTs each message's data to
// /messages and acks it when the answer is 2xx (a 4xx other than 408 and 429
// dead-letters it; 408, 429 and 5xx are retried). Messages of one project come one at
// a time, in order; different projects come concurrently.
//
//	handler -listen 127.0.0.1:8080 -delay 20ms [-record received.jsonl -name m-0]
//
// -listen unix:/path/to.sock listens on a Unix domain socket instead (the member sets
// SHOAL_HANDLER_SOCKET to that path), e.g. for a native sidecar sharing an emptyDir with it.
//
// With -record it writes, when it stops, one JSON line per message it answered 200:
// what an audit needs to prove nothing was lost, duplicated or reordered.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"log"
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

// received is one answered message, as -record writes it.
type received struct {
	ProjectID      string  `json:"project_id"`
	MessageID      string  `json:"message_id"`
	Partition      int     `json:"partition"`
	Member         string  `json:"member"`
	DeliveryCount  int     `json:"delivery_count"`
	StreamSequence int     `json:"stream_sequence"`
	Started        float64 `json:"started"`
	Finished       float64 `json:"finished"`
}

func seconds(t time.Time) float64 { return float64(t.UnixNano()) / 1e9 }

func header(r *http.Request, name string) int {
	n, _ := strconv.Atoi(r.Header.Get(name))
	return n
}

func main() {
	listen := flag.String("listen", "127.0.0.1:8080", "host:port, or unix:/path/to.sock")
	delay := flag.Duration("delay", 0, "time each message takes (e.g. 20ms)")
	verbose := flag.Bool("v", false, "log every message")
	record := flag.String("record", "", "write what was received to this file on exit")
	name := flag.String("name", "", "the member this handler serves (in -record's lines)")
	flag.Parse()

	var mu sync.Mutex
	var answered []received

	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
	})
	mux.HandleFunc("POST /messages", func(w http.ResponseWriter, r *http.Request) {
		started := time.Now()
		data, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		project := r.Header.Get("Shoal-Project-Id")
		if project == "" { // a 4xx: Shoal dead-letters the message at once
			http.Error(w, "no Shoal-Project-Id header", http.StatusBadRequest)
			return
		}
		if *delay > 0 { // (no timer at all for a handler that answers at once)
			select {
			case <-time.After(*delay): // the work this handler would do with data
			case <-r.Context().Done(): // the member gave up (timeout, fenced): it retries
				return
			}
		}
		if *verbose {
			log.Printf("project %s partition %s message %s delivery %s stream seq %s: %d bytes",
				project, r.Header.Get("Shoal-Partition"), r.Header.Get("Shoal-Message-Id"),
				r.Header.Get("Shoal-Delivery-Count"), r.Header.Get("Shoal-Stream-Sequence"), len(data))
		}
		if *record != "" {
			mu.Lock()
			answered = append(answered, received{
				ProjectID: project, MessageID: r.Header.Get("Shoal-Message-Id"),
				Partition: header(r, "Shoal-Partition"), Member: *name,
				DeliveryCount:  header(r, "Shoal-Delivery-Count"),
				StreamSequence: header(r, "Shoal-Stream-Sequence"),
				Started:        seconds(started), Finished: seconds(time.Now()),
			})
			mu.Unlock()
		}
		w.WriteHeader(http.StatusOK)
	})

	ln, err := listenOn(*listen)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("listening on %s", ln.Addr())
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			log.Fatal(err)
		}
	}()

	// On SIGTERM or SIGINT, answer the requests already open, then exit.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	<-ctx.Done()
	shutdown, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil {
		log.Fatal(err)
	}
	if *record != "" {
		if err := writeRecord(*record, answered); err != nil {
			log.Fatal(err)
		}
	}
	log.Print("stopped")
}

// listenOn listens on addr: host:port, or unix:/path/to.sock for a Unix domain socket.
// The socket file goes when the listener is closed (srv.Shutdown closes it): package net
// unlinks a socket it created.
func listenOn(addr string) (net.Listener, error) {
	path, ok := strings.CutPrefix(addr, "unix:")
	if !ok {
		return net.Listen("tcp", addr)
	}
	// A socket left by a run that was killed would fail Listen with "address already in
	// use". Only a socket is removed: anything else at path is not ours.
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSocket != 0 {
		if err := os.Remove(path); err != nil {
			return nil, err
		}
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	// Connecting needs write permission on the socket, which the umask (typically 022)
	// leaves to the owner alone; the member usually runs as another user. The directory is
	// the pod's own emptyDir, so every container of the pod may connect, and nothing else.
	if err := os.Chmod(path, 0o666); err != nil {
		ln.Close()
		return nil, err
	}
	return ln, nil
}

// writeRecord writes the lines to a temporary file and renames it: a reader never sees
// half a record.
func writeRecord(path string, lines []received) error {
	f, err := os.Create(path + ".tmp")
	if err != nil {
		return err
	}
	enc := json.NewEncoder(f)
	for _, line := range lines {
		if err := enc.Encode(line); err != nil {
			f.Close()
			return err
		}
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(path+".tmp", path)
}
