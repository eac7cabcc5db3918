defmodule PhoenixPubsubConvoy.Test.Nodes do
  @moduledoc false
  # Peer nodes for the cluster tests (run on the test node), and what the tests
  # ask of any node through :erpc (these modules are compiled into this
  # project's ebin, which every peer gets with -pa).
  import ExUnit.Assertions, only: [flunk: 1]

  @apps [:convoy, :phoenix_pubsub, :phoenix_pubsub_convoy, :elixir, :logger]

  @doc """
  Starts a peer node on 127.0.0.1 with the code paths of convoy, phoenix_pubsub,
  this project and Elixir, not linked to the caller (a test may halt it), and
  starts `apps` there. Options: `name` (to start a node again under the name it
  had), `args` (more command line arguments, as charlists).
  """
  def start_peer(apps, opts \\ []) do
    name = opts[:name] || :peer.random_name(~c"phx_convoy")
    paths = Enum.flat_map(@apps, &[~c"-pa", :code.lib_dir(&1, :ebin)])
    # The tests stop and halt nodes on purpose: no warnings from global about
    # the partitions that makes.
    quiet = [~c"-kernel", ~c"prevent_overlapping_partitions", ~c"false"]
    args = paths ++ quiet ++ Keyword.get(opts, :args, [])

    {:ok, peer, node} =
      :peer.start(%{
        name: name,
        host: ~c"127.0.0.1",
        longnames: true,
        args: args,
        wait_boot: 30_000
      })

    for app <- apps do
      {:ok, _} = :erpc.call(node, Application, :ensure_all_started, [app])
    end

    {peer, node, name}
  end

  @doc "Stops a peer node if it still runs."
  def stop_peer(peer) do
    :peer.stop(peer)
  catch
    # already gone (halted by its test)
    :exit, _ -> :ok
  end

  @doc "How convoy at `at` sends to `node`: :convoy, or :plain (not yet, or never)."
  def route(at, node) do
    get_in(:erpc.call(at, :convoy, :info, []), [:nodes, node, :route])
  end

  @doc "Messages convoy at `at` accepted for `node` (sent by lane or directly)."
  def accepted(at, node) do
    get_in(:erpc.call(at, :convoy, :info, []), [:nodes, node, :accepted]) || 0
  end

  @doc """
  Waits for `fun` to hold, looking every 20 ms for up to 10 s: for what has no
  message to wait for (convoy's hello between nodes, :pg's view of other nodes).
  """
  def await(fun, tries \\ 500) do
    cond do
      fun.() ->
        :ok

      tries > 0 ->
        Process.sleep(20)
        await(fun, tries - 1)

      true ->
        flunk("condition not met")
    end
  end

  @doc "Waits until each node's :pg sees `count` members of `group` in Phoenix.PubSub."
  def await_members(nodes, group, count) do
    for at <- nodes do
      await(fn -> length(:erpc.call(at, :pg, :get_members, [Phoenix.PubSub, group])) == count end)
    end

    :ok
  end

  @doc "Waits until convoy on each of `nodes` routes to each other one through convoy."
  def await_convoy(nodes) do
    for at <- nodes, to <- nodes, at != to, do: await(fn -> route(at, to) == :convoy end)
    :ok
  end

  ## Called on any node through :erpc

  @doc "Starts a supervisor of `children` that outlives the caller (an :erpc process)."
  def start_tree(children) do
    {:ok, sup} = Supervisor.start_link(children, strategy: :one_for_one)
    Process.unlink(sup)
    sup
  end

  @doc "A process that waits until killed (something to track)."
  def spawn_idle do
    spawn(fn -> receive do: (:never -> :ok) end)
  end

  @doc "This node's OS process id."
  def os_pid, do: List.to_integer(:os.getpid())
end

defmodule PhoenixPubsubConvoy.Test.Collector do
  @moduledoc false
  # A subscriber that keeps every message it gets, in arrival order, and gives
  # them to whoever sends it {:report, pid}. It tells `owner` of each
  # {:mark, _, _} ({:mark, self(), msg}), of every 100th {:m, _, i}
  # ({:at, self(), i}) and, with first: true, of its first message
  # ({:first, self(), msg}); with acks: pid it sends {:ack, i} to pid for every
  # 10th {:m, _, i}.

  def start(pubsub, topic, owner, opts \\ []) do
    caller = self()

    pid =
      spawn(fn ->
        :ok = Phoenix.PubSub.subscribe(pubsub, topic)
        send(caller, {:subscribed, self()})
        loop(%{owner: owner, acks: opts[:acks], first: opts[:first] == true, got: []})
      end)

    receive do
      {:subscribed, ^pid} -> pid
    after
      10_000 -> exit(:not_subscribed)
    end
  end

  # A burst's payload is not kept (reports cross nodes).
  defp kept({:b, i, _payload}), do: {:b, i}
  defp kept(msg), do: msg

  defp loop(s) do
    receive do
      {:report, from} ->
        send(from, {:report, self(), Enum.reverse(s.got)})
        loop(s)

      msg ->
        if s.first, do: send(s.owner, {:first, self(), msg})

        case msg do
          {:mark, _, _} ->
            send(s.owner, {:mark, self(), msg})

          {:m, _, i} ->
            if s.acks != nil and rem(i, 10) == 0, do: send(s.acks, {:ack, i})
            if rem(i, 100) == 0, do: send(s.owner, {:at, self(), i})

          _ ->
            :ok
        end

        loop(%{s | got: [kept(msg) | s.got], first: false})
    end
  end
end

defmodule PhoenixPubsubConvoy.Test.Publisher do
  @moduledoc false
  # A publishing process on some node, driven by its owner:
  #   {:publish, n, nodes} - publishes {:m, id, 1..n}: every third one by
  #     direct_broadcast to each of `nodes` (to this node: by direct_broadcast
  #     when direct_self, by local_broadcast otherwise), the others by
  #     broadcast; answers {:published, self(), results that were not :ok}
  #   {:mark, round} - broadcasts {:mark, id, round}; answers {:marked, self()}
  #   {:apply, calls} - applies each {module, function, args} in turn; answers
  #     {:applied, self(), results}
  #   {:burst, pubsub, n, payload} - broadcasts {:b, 1..n, payload} on pubsub;
  #     answers {:burst, self(), %{result => count}, longest call in us}
  #   {:stream, window} - publishes {:m, id, 1, 2, ...} by broadcast until told
  #     {:stop, from}, holding at most `window` beyond the last {:ack, i} it got;
  #     then broadcasts {:mark, id, 1} and answers
  #     {:stopped, self(), last i, results that were not :ok, longest call in us}

  def start(pubsub, topic, id, owner, opts \\ []) do
    state = %{
      pubsub: pubsub,
      topic: topic,
      id: id,
      owner: owner,
      direct_self: opts[:direct_self] != false
    }

    spawn(fn -> loop(state) end)
  end

  defp loop(s) do
    receive do
      {:publish, n, nodes} ->
        errors = Enum.flat_map(1..n, &publish(s, &1, nodes))
        send(s.owner, {:published, self(), errors})
        loop(s)

      {:mark, round} ->
        :ok = Phoenix.PubSub.broadcast(s.pubsub, s.topic, {:mark, s.id, round})
        send(s.owner, {:marked, self()})
        loop(s)

      {:apply, calls} ->
        results = for {m, f, a} <- calls, do: apply(m, f, a)
        send(s.owner, {:applied, self(), results})
        loop(s)

      {:burst, pubsub, n, payload} ->
        {results, longest} =
          Enum.reduce(1..n, {%{}, 0}, fn i, {results, longest} ->
            {us, result} =
              :timer.tc(Phoenix.PubSub, :broadcast, [pubsub, s.topic, {:b, i, payload}])

            {Map.update(results, result, 1, &(&1 + 1)), max(longest, us)}
          end)

        send(s.owner, {:burst, self(), results, longest})
        loop(s)

      {:stream, window} ->
        stream(s, window, 1, 0, [], 0)

      :exit ->
        :ok
    end
  end

  defp publish(s, i, nodes) when rem(i, 3) == 0 do
    msg = {:m, s.id, i}

    Enum.flat_map(nodes, fn node ->
      case direct(s, node, msg) do
        :ok -> []
        other -> [{i, node, other}]
      end
    end)
  end

  defp publish(s, i, _nodes) do
    case Phoenix.PubSub.broadcast(s.pubsub, s.topic, {:m, s.id, i}) do
      :ok -> []
      other -> [{i, :broadcast, other}]
    end
  end

  defp direct(%{direct_self: false} = s, node, msg) when node == node() do
    Phoenix.PubSub.local_broadcast(s.pubsub, s.topic, msg)
  end

  defp direct(s, node, msg), do: Phoenix.PubSub.direct_broadcast(node, s.pubsub, s.topic, msg)

  defp stream(s, window, i, acked, errors, longest) do
    receive do
      {:stop, from} ->
        :ok = Phoenix.PubSub.broadcast(s.pubsub, s.topic, {:mark, s.id, 1})
        send(from, {:stopped, self(), i - 1, Enum.reverse(errors), longest})
    after
      0 ->
        acked = if i - acked > window, do: await_ack(i - window), else: acked
        t0 = System.monotonic_time()
        result = Phoenix.PubSub.broadcast(s.pubsub, s.topic, {:m, s.id, i})
        us = System.convert_time_unit(System.monotonic_time() - t0, :native, :microsecond)
        errors = if result == :ok, do: errors, else: [{i, result} | errors]
        stream(s, window, i + 1, acked, errors, max(longest, us))
    end
  end

  # The first ack of `at` or later (acks come in order, every 10th message).
  defp await_ack(at) do
    receive do
      {:ack, j} when j >= at -> j
      {:ack, _} -> await_ack(at)
    end
  end
end

defmodule PhoenixPubsubConvoy.Test.Tracker do
  @moduledoc false
  # A Phoenix.Tracker that sends each diff it is given to `report_to`, as
  # {:diff, node(), diff}.
  use Phoenix.Tracker

  def start_link(opts), do: Phoenix.Tracker.start_link(__MODULE__, opts, opts)

  @impl true
  def init(opts), do: {:ok, Keyword.fetch!(opts, :report_to)}

  @impl true
  def handle_diff(diff, report_to) do
    send(report_to, {:diff, node(), diff})
    {:ok, report_to}
  end
end
