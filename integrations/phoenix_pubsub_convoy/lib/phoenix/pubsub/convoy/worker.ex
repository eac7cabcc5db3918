defmodule Phoenix.PubSub.Convoy.Worker do
  @moduledoc false
  # One per group of the pool on each node: registered under the group's name and
  # a member of that group in the :pg scope Phoenix.PubSub, as
  # Phoenix.PubSub.PG2's workers are, so that PG2 nodes find it and send to it, and
  # it takes what they send. It dispatches each broadcast it is given to this
  # node's subscribers. The messages come through convoy's inbox from nodes that
  # run this adapter and convoy, by plain sends from the others.
  use GenServer

  def start_link({pubsub, group}) do
    GenServer.start_link(__MODULE__, {pubsub, group}, name: group)
  end

  @impl true
  def init({pubsub, group}) do
    # A busy worker's queue is kept off its heap (no copying of it at each GC).
    Process.flag(:message_queue_data, :off_heap)
    :ok = :pg.join(Phoenix.PubSub, group, self())
    {:ok, pubsub}
  end

  @impl true
  def handle_info({:forward_to_local, topic, message, dispatcher}, pubsub) do
    Phoenix.PubSub.local_broadcast(pubsub, topic, message, dispatcher)
    {:noreply, pubsub}
  end

  # Anything else is ignored, as PG2's workers ignore it: a stray message must
  # not stop this node's broadcasts.
  def handle_info(_other, pubsub) do
    {:noreply, pubsub}
  end
end
