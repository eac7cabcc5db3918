defmodule Phoenix.PubSub.ConvoyClusterTest do
  # Phoenix.PubSub over convoy between :peer nodes. Every test starts its own
  # PubSub (a name of its own) on the nodes it uses; two peers running convoy
  # are shared, the tests that halt, stall or mix nodes start their own.
  use ExUnit.Case, async: false

  import PhoenixPubsubConvoy.Test.Nodes
  alias PhoenixPubsubConvoy.Test.{Collector, Publisher, Tracker}
  alias Phoenix.PubSub

  @moduletag timeout: 120_000
  @wait 20_000

  setup_all do
    {b_peer, b, _} = start_peer([:phoenix_pubsub_convoy])
    {c_peer, c, _} = start_peer([:phoenix_pubsub_convoy])
    on_exit(fn -> Enum.each([b_peer, c_peer], &stop_peer/1) end)
    await_convoy([node(), b, c])
    %{nodes: [node(), b, c]}
  end

  test "broadcast reaches every subscriber on every node once; direct_broadcast only the named node's",
       %{nodes: nodes} do
    {pubsub, topic} = new_pubsub(nodes)
    collectors = for at <- nodes, _ <- 1..2, do: {at, collector(at, pubsub, topic)}
    publishers = for at <- nodes, do: {at, publisher(at, pubsub, topic, at)}

    # From each node: one broadcast, one direct_broadcast to each node (itself
    # included), then a mark behind them (a barrier: per-publisher order).
    for {at, pub} <- publishers do
      calls =
        [{PubSub, :broadcast, [pubsub, topic, {:m, at, 1}]}] ++
          for(to <- nodes, do: {PubSub, :direct_broadcast, [to, pubsub, topic, {:d, at, to}]}) ++
          [{PubSub, :broadcast, [pubsub, topic, {:mark, at, 1}]}]

      send(pub, {:apply, calls})
      assert_receive {:applied, ^pub, results}, @wait
      assert Enum.all?(results, &(&1 == :ok))
    end

    await_marks(collectors, nodes, 1)

    for {at, c} <- collectors do
      got = Enum.group_by(report(c), &elem(&1, 1))

      for from <- nodes do
        assert got[from] == [{:m, from, 1}, {:d, from, at}, {:mark, from, 1}]
      end
    end

    # the remote parts went through convoy
    for at <- nodes, to <- nodes, at != to, do: assert(accepted(at, to) > 0)
  end

  for policy <- [:drop, :settings] do
    @tag policy: policy
    test "order per publisher and subscriber: 9 publishers on 3 nodes, overload: #{policy}",
         %{nodes: nodes, policy: policy} do
      n = 1000
      {pubsub, topic} = new_pubsub(nodes, overload: policy, pool_size: 2)
      collectors = for at <- nodes, _ <- 1..2, do: {at, collector(at, pubsub, topic)}

      publishers =
        for at <- nodes, k <- 1..3, do: {{at, k}, publisher(at, pubsub, topic, {at, k})}

      # Broadcasts, and every third message a direct_broadcast to each node
      # (this one included), from all publishers at once.
      for {_, pub} <- publishers, do: send(pub, {:publish, n, nodes})
      for {_, pub} <- publishers, do: assert_receive({:published, ^pub, []}, @wait)
      for {_, pub} <- publishers, do: send(pub, {:mark, 1})
      await_marks(collectors, Enum.map(publishers, &elem(&1, 0)), 1)

      for {_, c} <- collectors do
        got = Enum.group_by(report(c), &elem(&1, 1))

        for {id, _} <- publishers do
          assert got[id] == Enum.map(1..n, &{:m, id, &1}) ++ [{:mark, id, 1}]
        end
      end
    end
  end

  test "a node halted and started again mid-traffic: the others miss nothing, it gets what follows, in order" do
    {b_peer, b, _} = start_peer([:phoenix_pubsub_convoy])
    {c_peer, c, c_name} = start_peer([:phoenix_pubsub_convoy])
    on_exit(fn -> Enum.each([b_peer, c_peer], &stop_peer/1) end)
    nodes = [node(), b, c]
    await_convoy(nodes)
    {pubsub, topic} = new_pubsub(nodes)

    # One publisher here, paced by the subscriber on b (at most 100 messages
    # beyond its acknowledgements); a subscriber on c.
    pub = publisher(node(), pubsub, topic, :p)
    cb = collector(b, pubsub, topic, acks: pub)
    _ = collector(c, pubsub, topic)
    send(pub, {:stream, 100})
    assert_receive {:at, ^cb, 300}, @wait

    Node.monitor(c, true)
    :erpc.cast(c, :erlang, :halt, [])
    assert_receive {:nodedown, ^c}, @wait
    # the traffic to b goes on
    await_at(cb, latest_at(cb) + 200)

    # c again, under its name: its new subscriber gets every message from its
    # first one on.
    {c_peer, ^c, _} = start_peer([:phoenix_pubsub_convoy], name: c_name)
    on_exit(fn -> stop_peer(c_peer) end)
    start_pubsub([c], pubsub)
    cc = collector(c, pubsub, topic, first: true)
    assert_receive {:first, ^cc, {:m, :p, first}}, @wait
    await_at(cb, first + 200)

    send(pub, {:stop, self()})
    assert_receive {:stopped, ^pub, last, errors, longest_us}, @wait
    assert errors == []
    # never held by the halted node (convoy's block_timeout is 5 s)
    assert longest_us < 2_000_000
    assert_receive {:mark, ^cb, _}, @wait
    assert_receive {:mark, ^cc, _}, @wait
    assert report(cb) == Enum.map(1..last, &{:m, :p, &1}) ++ [{:mark, :p, 1}]
    assert report(cc) == Enum.map(first..last, &{:m, :p, &1}) ++ [{:mark, :p, 1}]
  end

  test "a stalled node: a broadcast never waits for it (drop), or returns {:error, :overload} (error, block)" do
    # a publishing node with a small bound for each node (500 messages)
    {a_peer, a, _} =
      start_peer([:phoenix_pubsub_convoy], args: [~c"-convoy", ~c"max_buffered", ~c"500"])

    {s_peer, s, _} = start_peer([:phoenix_pubsub_convoy])
    on_exit(fn -> Enum.each([a_peer, s_peer], &stop_peer/1) end)
    await_convoy([a, s])
    {drop, topic} = new_pubsub([a, s], overload: :drop)
    {error, _} = new_pubsub([a, s], overload: :error)
    {block, _} = new_pubsub([a, s], overload: :block, block_timeout: 200)
    cs = collector(s, drop, topic)
    pub = publisher(a, drop, topic, :p)

    os_pid = :erpc.call(s, PhoenixPubsubConvoy.Test.Nodes, :os_pid, [])
    signal(os_pid, "STOP")
    # (run before the peers stop: on_exit callbacks run last first)
    on_exit(fn -> System.cmd("sh", ["-c", "kill -CONT #{os_pid}"]) end)

    # 20 MB for a node that reads nothing: its connection's buffers fill, then
    # convoy's bound; the rest is dropped, and no broadcast waits.
    payload = :binary.copy(<<7>>, 4096)
    send(pub, {:burst, drop, 5000, payload})
    assert_receive {:burst, ^pub, %{ok: 5000}, longest_us}, @wait
    assert longest_us < 2_000_000
    assert get_in(:erpc.call(a, :convoy, :info, []), [:nodes, s, :dropped]) > 0

    # A stopped node's kernel may still take a little now and then (its TCP
    # window reopens a crack), so a send may find room: every broadcast is
    # either refused (counted in `refused`) or accepted, never dropped.
    before = node_counts(a, s)
    send(pub, {:burst, error, 300, payload})
    assert_receive {:burst, ^pub, results, longest_us}, @wait
    assert Map.keys(results) -- [:ok, {:error, :overload}] == []
    refused = Map.get(results, {:error, :overload}, 0)
    assert refused > 0
    assert longest_us < 2_000_000
    after_error = accounted(a, s, before, Map.get(results, :ok, 0))
    assert after_error.refused - before.refused == refused
    assert after_error.dropped == before.dropped
    # and what convoy holds for the node is within its bound (500 messages)
    assert after_error.queued <= 500

    # `block` waits up to its block_timeout (200 ms), then refuses.
    send(pub, {:burst, block, 5, payload})
    assert_receive {:burst, ^pub, results, longest_us}, @wait
    assert Map.keys(results) -- [:ok, {:error, :overload}] == []
    assert Map.get(results, {:error, :overload}, 0) > 0
    assert longest_us < 2_000_000

    # Going again, the node gets what was not dropped, in order, and what follows
    # (once the publisher's messages held for it have left: flush/0).
    signal(os_pid, "CONT")

    flush_then_mark = [{:convoy, :flush, []}, {PubSub, :broadcast, [drop, topic, {:mark, :p, 1}]}]
    send(pub, {:apply, flush_then_mark})

    assert_receive {:applied, ^pub, [:ok, :ok]}, @wait
    assert_receive {:mark, ^cs, {:mark, :p, 1}}, @wait
    got = report(cs)
    assert List.last(got) == {:mark, :p, 1}
    indices = for {:b, i} <- got, do: i
    assert indices == Enum.sort(Enum.uniq(indices))
  end

  test "a mixed cluster: PG2 and convoy nodes under one PubSub name broadcast to each other" do
    # p runs Phoenix.PubSub.PG2 and not convoy (an old release); q and this node
    # the convoy adapter; r the convoy adapter without convoy running (its sends
    # are plain ones). Same name, same pool size.
    {p_peer, p, _} = start_peer([:phoenix_pubsub])
    {q_peer, q, _} = start_peer([:phoenix_pubsub_convoy])
    {r_peer, r, _} = start_peer([:phoenix_pubsub])
    on_exit(fn -> Enum.each([p_peer, q_peer, r_peer], &stop_peer/1) end)
    await_convoy([node(), q])
    nodes = [node(), p, q, r]
    n = 300
    name = unique_name()
    topic = "mixed"
    start_pubsub([p], name, pool_size: 2, adapter: Phoenix.PubSub.PG2)
    start_pubsub([node(), q, r], name, pool_size: 2)
    await_groups(nodes, name, 2)
    collectors = for at <- nodes, do: {at, collector(at, name, topic)}

    # PG2 dispatches a direct_broadcast to its own node in its worker, behind the
    # caller's own local broadcasts: there, use local_broadcast for order.
    publishers = for at <- nodes, do: {at, publisher(at, name, topic, at, direct_self: false)}

    for {_, pub} <- publishers, do: send(pub, {:publish, n, nodes})
    for {_, pub} <- publishers, do: assert_receive({:published, ^pub, []}, @wait)
    for {_, pub} <- publishers, do: send(pub, {:mark, 1})
    await_marks(collectors, nodes, 1)

    for {_, c} <- collectors do
      got = Enum.group_by(report(c), &elem(&1, 1))

      for from <- nodes do
        assert got[from] == Enum.map(1..n, &{:m, from, &1}) ++ [{:mark, from, 1}]
      end
    end

    assert route(node(), q) == :convoy
    assert route(node(), p) == :plain
    assert route(node(), r) == :plain
    assert accepted(node(), q) > 0
    assert :erpc.call(r, :convoy, :info, []).running == false
  end

  test "Phoenix.Tracker replicates presences across three nodes over the adapter",
       %{nodes: nodes} do
    {pubsub, _} = new_pubsub(nodes)
    tracker = unique_name()

    for at <- nodes do
      opts = [
        name: tracker,
        pubsub_server: pubsub,
        report_to: self(),
        broadcast_period: 50,
        down_period: 1_000
      ]

      sup = :erpc.call(at, PhoenixPubsubConvoy.Test.Nodes, :start_tree, [[{Tracker, opts}]])
      on_exit(fn -> stop_tree(at, sup) end)
    end

    tracked =
      for at <- nodes, into: %{} do
        pid = :erpc.call(at, PhoenixPubsubConvoy.Test.Nodes, :spawn_idle, [])
        key = "user@#{at}"
        {:ok, _} = :erpc.call(at, Phoenix.Tracker, :track, [tracker, pid, "room", key, %{at: at}])
        {key, pid}
      end

    # every node is told of every join (its own through handle_diff too)
    keys = tracked |> Map.keys() |> Enum.sort()
    seen = await_presences(Map.new(nodes, &{&1, MapSet.new()}), keys)
    for at <- nodes, do: assert(listed(at, tracker) == keys)

    # a tracked process on a peer ends: every node is told it left
    {gone_key, gone_pid} = Enum.find(tracked, fn {_, pid} -> node(pid) != node() end)
    :erpc.call(node(gone_pid), Process, :exit, [gone_pid, :kill])
    await_presences(seen, keys -- [gone_key])
    for at <- nodes, do: assert(listed(at, tracker) == keys -- [gone_key])
  end

  ## Helpers

  defp unique_name, do: :"#{__MODULE__}.N#{System.unique_integer([:positive])}"

  # A PubSub with the convoy adapter (and `opts`) on each node, seen by all.
  defp new_pubsub(nodes, opts \\ []) do
    name = unique_name()
    start_pubsub(nodes, name, opts)
    await_groups(nodes, name, Keyword.get(opts, :pool_size, 1))
    {name, "topic"}
  end

  defp start_pubsub(nodes, name, opts \\ []) do
    opts = [name: name, adapter: Phoenix.PubSub.Convoy] |> Keyword.merge(opts)

    for at <- nodes do
      sup = :erpc.call(at, PhoenixPubsubConvoy.Test.Nodes, :start_tree, [[{PubSub, opts}]])
      on_exit(fn -> stop_tree(at, sup) end)
    end

    :ok
  end

  # The publishing node's counts for `node`.
  defp node_counts(at, node) do
    get_in(:erpc.call(at, :convoy, :info, []), [:nodes, node])
    |> Map.take([:accepted, :dropped, :refused, :queued])
  end

  # The counts once the node's `accepted` (which may trail a moment behind)
  # has grown by `ok` since `before`.
  defp accounted(at, node, before, ok, tries \\ 100) do
    now = node_counts(at, node)
    accepted = now.accepted - before.accepted

    cond do
      accepted == ok ->
        now

      tries > 0 ->
        Process.sleep(20)
        accounted(at, node, before, ok, tries - 1)

      true ->
        flunk("convoy counted #{accepted} broadcasts accepted, the burst #{ok}")
    end
  end

  # sh's own kill: no procps needed
  defp signal(os_pid, name), do: {_, 0} = System.cmd("sh", ["-c", "kill -#{name} #{os_pid}"])

  defp stop_tree(at, sup) do
    :erpc.call(at, Supervisor, :stop, [sup])
  catch
    _, _ -> :ok
  end

  # Each group of the pool has one worker on each node, as each node sees it.
  defp await_groups(nodes, name, pool_size) do
    adapter = Module.concat(name, "Adapter")
    groups = [adapter | for(k <- 2..pool_size//1, do: :"#{adapter}_#{k}")]
    for group <- groups, do: await_members(nodes, group, length(nodes))
  end

  defp collector(at, pubsub, topic, opts \\ []) do
    :erpc.call(at, Collector, :start, [pubsub, topic, self(), opts])
  end

  defp publisher(at, pubsub, topic, id, opts \\ []) do
    :erpc.call(at, Publisher, :start, [pubsub, topic, id, self(), opts])
  end

  defp report(c) do
    send(c, {:report, self()})
    assert_receive {:report, ^c, msgs}, @wait
    msgs
  end

  # Every collector got the mark of `round` from every publisher id.
  defp await_marks(collectors, ids, round) do
    for {_, c} <- collectors, id <- ids do
      assert_receive {:mark, ^c, {:mark, ^id, ^round}}, @wait
    end
  end

  # The highest {:at, c, i} received so far (0 if none).
  defp latest_at(c, latest \\ 0) do
    receive do
      {:at, ^c, i} -> latest_at(c, max(i, latest))
    after
      0 -> latest
    end
  end

  # The first {:at, c, i} with i >= at_least; returns i.
  defp await_at(c, at_least) do
    receive do
      {:at, ^c, i} when i >= at_least -> i
      {:at, ^c, _} -> await_at(c, at_least)
    after
      @wait -> flunk("#{inspect(c)} did not reach #{at_least}")
    end
  end

  # Follows the trackers' diffs on "room" (from `seen`, the keys each node has
  # present) until every node has `keys`; returns what each node has.
  defp await_presences(seen, keys) do
    if Enum.all?(seen, fn {_, present} -> Enum.sort(present) == keys end) do
      seen
    else
      receive do
        {:diff, at, %{"room" => {joins, leaves}}} ->
          present = Enum.reduce(leaves, seen[at], fn {key, _}, acc -> MapSet.delete(acc, key) end)
          present = Enum.reduce(joins, present, fn {key, _}, acc -> MapSet.put(acc, key) end)
          await_presences(Map.put(seen, at, present), keys)
      after
        @wait -> flunk("presences not replicated: #{inspect(seen)}")
      end
    end
  end

  defp listed(at, tracker) do
    :erpc.call(at, Phoenix.Tracker, :list, [tracker, "room"])
    |> Enum.map(&elem(&1, 0))
    |> Enum.sort()
  end
end
