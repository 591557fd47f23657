// Command producer publishes to a Shoal consumer group from Go, with nats.go and no
// Shoal library: a project's partition is a pure function of its id (the contract in
// contracts/partition-vectors.json).
//
//	producer -vectors contracts/partition-vectors.json   # check Partition, exit 1 on a mismatch
//	producer -url nats://127.0.0.1:4222 -prefix shoal.default.orders -partitions 128 \
//	    -count 10000 -projects 1000
package main

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"math/big"
	"os"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Partition is Shoal's partition function: the SHA-256 of the id's UTF-8 bytes, read as
// one unsigned big-endian 256-bit integer, modulo the group's partitions. (A Go string
// holds the bytes it was given; hash them as they are, without normalising.)
func Partition(projectID string, partitions int) int {
	sum := sha256.Sum256([]byte(projectID))
	n := new(big.Int).SetBytes(sum[:])
	return int(n.Mod(n, big.NewInt(int64(partitions))).Int64())
}

func main() {
	vectors := flag.String("vectors", "", "check Partition against this vectors file, then exit")
	url := flag.String("url", nats.DefaultURL, "NATS server URL")
	prefix := flag.String("prefix", "", "the group's subject prefix, required (a group's default is shoal.<namespace>.<group>)")
	partitions := flag.Int("partitions", 128, "the group's partitions")
	count := flag.Int("count", 1000, "messages to publish")
	projects := flag.Int("projects", 100, "project ids, project-0 .. project-N-1 (message i goes to i mod N)")
	pending := flag.Int("max-pending", 256, "publishes awaiting JetStream's acknowledgement at once")
	runID := flag.String("run-id", defaultRunID(), "prefix of the message ids (publish again with the same one to add only what is missing)")
	flag.Parse()

	if *vectors != "" {
		os.Exit(checkVectors(*vectors))
	}
	if *prefix == "" || *partitions < 1 || *projects < 1 || *pending < 1 {
		log.Fatal("publishing needs -prefix, -partitions >= 1, -projects >= 1 and -max-pending >= 1")
	}
	nc, err := nats.Connect(*url, nats.Name("shoal-go-producer"))
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	// At most -max-pending publishes await JetStream's acknowledgement.
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(*pending))
	if err != nil {
		log.Fatal(err)
	}

	start := time.Now()
	acks := make([]jetstream.PubAckFuture, 0, *count)
	for i := 0; i < *count; i++ {
		project, seq := fmt.Sprintf("project-%d", i%*projects), i / *projects
		msg := nats.NewMsg(fmt.Sprintf("%s.%d", *prefix, Partition(project, *partitions)))
		msg.Header.Set("Shoal-Project-Id", project)
		// JetStream drops a message whose id it has seen (in its duplicate window), so
		// publishing again with the same -run-id cannot duplicate anything.
		msg.Header.Set("Nats-Msg-Id", fmt.Sprintf("%s-%s-%d", *runID, project, seq))
		msg.Header.Set("Shoal-Seq", strconv.Itoa(seq)) // the project's count, for audits
		msg.Data = fmt.Appendf(nil, "%s:%d", project, seq)
		// When -max-pending acks are outstanding a publish waits for one; by default only 200 ms,
		// then fails. A server busy storing a burst (and serving its consumers) can take
		// longer than that, which is no reason to give up: wait up to 30 s.
		ack, err := js.PublishMsgAsync(msg, jetstream.WithStallWait(30*time.Second))
		if err != nil {
			log.Fatalf("publish %d: %v", i, err)
		}
		acks = append(acks, ack)
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(30 * time.Second):
		log.Fatalf("%d publishes still unacknowledged after 30 s", js.PublishAsyncPending())
	}
	for i, ack := range acks {
		select {
		case <-ack.Ok():
		case err := <-ack.Err():
			log.Fatalf("publish %d failed: %v (publish again with -run-id %s)", i, err, *runID)
		}
	}
	seconds := time.Since(start).Seconds()
	fmt.Printf("{\"published\": %d, \"seconds\": %.3f, \"run_id\": %q}\n", len(acks), seconds, *runID)
}

// defaultRunID is the millisecond clock and 6 random hex digits, as Shoal's own producer
// makes it (1764316800000_3f9a1c): two runs started in the same millisecond must not share
// message ids, or JetStream drops the second one's as duplicates. No "-" in it, so a
// message id RUN-PROJECT-N still splits at its first "-" into the run id.
func defaultRunID() string {
	suffix := make([]byte, 3)
	if _, err := rand.Read(suffix); err != nil {
		log.Fatal(err)
	}
	return fmt.Sprintf("%d_%s", time.Now().UnixMilli(), hex.EncodeToString(suffix))
}

// checkVectors compares Partition with every vector; 0 if all match, else 1.
func checkVectors(path string) int {
	raw, err := os.ReadFile(path)
	if err != nil {
		log.Fatal(err)
	}
	var file struct {
		SamplePrefix string `json:"sample_prefix"`
		Vectors      []struct {
			Note       string `json:"note"`
			ProjectID  string `json:"project_id"`
			UTF8Hex    string `json:"project_id_utf8_hex"`
			Partitions int    `json:"partitions"`
			Partition  int    `json:"partition"`
			Subject    string `json:"subject"`
		} `json:"vectors"`
	}
	if err := json.Unmarshal(raw, &file); err != nil {
		log.Fatal(err)
	}
	failed := 0
	for _, v := range file.Vectors {
		got := Partition(v.ProjectID, v.Partitions)
		subject := fmt.Sprintf("%s.%d", file.SamplePrefix, got)
		if got != v.Partition || subject != v.Subject || hex.EncodeToString([]byte(v.ProjectID)) != v.UTF8Hex {
			failed++
			fmt.Printf("MISMATCH %s (%q, %d partitions): got %d, want %d\n", v.Note, v.ProjectID, v.Partitions, got, v.Partition)
		}
	}
	if len(file.Vectors) == 0 {
		fmt.Println("no vectors in", path)
		return 1
	}
	fmt.Printf("%d vectors, %d mismatches\n", len(file.Vectors), failed)
	if failed > 0 {
		return 1
	}
	return 0
}
