defmodule Phoenix.PubSub.Convoy do
  @moduledoc """
  A `Phoenix.PubSub` adapter whose messages between nodes travel through convoy.

      children = [
        {Phoenix.PubSub, name: MyApp.PubSub, adapter: Phoenix.PubSub.Convoy}
      ]

  It speaks the `Phoenix.PubSub.PG2` protocol: the same `:pg` scope
  (`Phoenix.PubSub`) and groups (the adapter name, then `<adapter name>_2` ... for
  a pool), workers registered under the group names, and the same message,
  `{:forward_to_local, topic, message, dispatcher}`. Nodes running this adapter
  and nodes running `Phoenix.PubSub.PG2` under the same PubSub name (and the same
  pool sizes) broadcast to each other, so a cluster can move from one to the other
  node by node. What changes is the sending: each remote part of a broadcast is a
  `:convoy.send/3` (or `:convoy.multicast/2`), batched with the node's other convoy
  traffic to the same node.

  ## Options

  Given with the others to `Phoenix.PubSub`:

    * `:pool_size`, `:broadcast_pool_size` - as for `Phoenix.PubSub.PG2` (keep
      the same values as PG2 nodes of the same PubSub while both run)
    * `:overload` - what a broadcast does when convoy already holds its bound
      (`max_buffered`, `max_buffered_bytes`) for a node, per call:
      * `:drop` (default) - that node's copy is dropped (counted in convoy's
        `dropped`), the broadcast returns `:ok` at once
      * `:error` - that node's copy is dropped (counted in `refused`), the other
        nodes get theirs, and the broadcast returns `{:error, :overload}`
        (`Phoenix.PubSub.broadcast/4` then skips this node's subscribers, and
        `broadcast!/4` raises)
      * `:block` - waits up to `:block_timeout` ms for room, then as `:error`
      * `:settings` - `:convoy.multicast/2` and `:convoy.send/2`: convoy's own
        `overload` setting applies (by default it waits up to 5 s, then drops)
    * `:block_timeout` - with `overload: :block` only: the wait in ms (default:
      convoy's `block_timeout` setting)
  """

  @behaviour Phoenix.PubSub.Adapter
  use Supervisor

  # The :pg scope phoenix_pubsub's application starts and Phoenix.PubSub.PG2 uses.
  @scope Phoenix.PubSub
  @policies [:drop, :error, :block, :settings]

  ## Adapter callbacks

  @impl Phoenix.PubSub.Adapter
  def node_name(_adapter_name), do: node()

  # The other nodes' workers of this caller's group get one message each (a
  # group has one worker per node); this node's subscribers are Phoenix's to
  # dispatch to, once the adapter returned :ok.
  @impl Phoenix.PubSub.Adapter
  def broadcast(adapter_name, topic, message, dispatcher) do
    {groups, _pubsub, policy} = :persistent_term.get({__MODULE__, adapter_name})
    here = node()
    remote = for pid <- :pg.get_members(@scope, pick(groups)), node(pid) != here, do: pid
    send_all(remote, {:forward_to_local, topic, message, dispatcher}, policy)
  end

  # To this node: dispatched here, in the caller (as broadcast/4's local part
  # is), so it keeps its order with the caller's broadcasts. To another node:
  # to this caller's group's worker there, by name.
  @impl Phoenix.PubSub.Adapter
  def direct_broadcast(adapter_name, node_name, topic, message, dispatcher) do
    {groups, pubsub, policy} = :persistent_term.get({__MODULE__, adapter_name})

    if node_name == node() do
      Phoenix.PubSub.local_broadcast(pubsub, topic, message, dispatcher)
    else
      send_one({pick(groups), node_name}, {:forward_to_local, topic, message, dispatcher}, policy)
    end
  end

  # As Phoenix.PubSub.PG2: a caller always uses the same group, so its messages
  # to a node all go through one worker there, in the order sent.
  defp pick(groups), do: elem(groups, :erlang.phash2(self(), tuple_size(groups)))

  defp send_all(pids, message, :settings), do: :convoy.multicast(pids, message)

  defp send_all(pids, message, opts) do
    Enum.reduce(pids, :ok, fn pid, result ->
      case :convoy.send(pid, message, opts) do
        :ok -> result
        {:error, :overload} = error -> error
      end
    end)
  end

  defp send_one(dest, message, :settings), do: :convoy.send(dest, message)
  defp send_one(dest, message, opts), do: :convoy.send(dest, message, opts)

  ## Supervisor

  @impl Phoenix.PubSub.Adapter
  def child_spec(opts) do
    _ = policy!(opts)
    %{id: __MODULE__, start: {__MODULE__, :start_link, [opts]}, type: :supervisor}
  end

  @doc false
  def start_link(opts) do
    name = Keyword.fetch!(opts, :name)
    adapter_name = Keyword.fetch!(opts, :adapter_name)
    pool_size = Keyword.get(opts, :pool_size, 1)
    broadcast_pool_size = Keyword.get(opts, :broadcast_pool_size, pool_size)

    if pool_size < broadcast_pool_size do
      {:error,
       "the :pool_size option must be greater than or equal to the :broadcast_pool_size option"}
    else
      arg = {name, adapter_name, pool_size, broadcast_pool_size, policy!(opts)}
      Supervisor.start_link(__MODULE__, arg, name: :"#{adapter_name}_supervisor")
    end
  end

  @impl Supervisor
  def init({name, adapter_name, pool_size, broadcast_pool_size, policy}) do
    broadcast_groups = List.to_tuple(groups(adapter_name, broadcast_pool_size))
    # The groups under the adapter's name, as PG2 keeps them; everything the
    # callbacks read under this module's key, in one lookup.
    :persistent_term.put(adapter_name, broadcast_groups)
    :persistent_term.put({__MODULE__, adapter_name}, {broadcast_groups, name, policy})

    children =
      for group <- groups(adapter_name, pool_size) do
        Supervisor.child_spec({Phoenix.PubSub.Convoy.Worker, {name, group}}, id: group)
      end

    Supervisor.init(children, strategy: :one_for_one)
  end

  # PG2's names: the first group is the adapter name itself.
  defp groups(adapter_name, pool_size) do
    [adapter_name | for(n <- 2..pool_size//1, do: :"#{adapter_name}_#{n}")]
  end

  # The per-call options of :convoy.send/3, or :settings.
  defp policy!(opts) do
    overload = Keyword.get(opts, :overload, :drop)

    unless overload in @policies do
      raise ArgumentError,
            "invalid :overload option #{inspect(overload)} for #{inspect(__MODULE__)}, " <>
              "expected one of #{inspect(@policies)}"
    end

    case {overload, Keyword.fetch(opts, :block_timeout)} do
      {:settings, :error} ->
        :settings

      {_, :error} ->
        %{overload: overload}

      {:block, {:ok, ms}} when is_integer(ms) and ms >= 0 and ms <= 3_600_000 ->
        %{overload: :block, block_timeout: ms}

      {:block, {:ok, ms}} ->
        raise ArgumentError,
              "invalid :block_timeout option #{inspect(ms)} for #{inspect(__MODULE__)}, " <>
                "expected an integer from 0 to 3600000 (ms)"

      {_, {:ok, _}} ->
        raise ArgumentError,
              "the :block_timeout option of #{inspect(__MODULE__)} needs overload: :block"
    end
  end
end
